"""Render the measured results pages from the benchmarks' JSON files, never from typed figures.

    python -m bench.report            # write docs/results.md and README.md's headline block
    python -m bench.report --check    # exit 1, naming the page, if a committed page differs

FIGURES below is the one map of figure -> JSON file(s) under bench/results/ -> the documented
command; the renderers are in bench/report/tables.py. Each table carries, under it, the command
that runs it today (the registry's) and the command that produced each file, its commit and machine: from the file's `provenance` (bench.write_result),
else from what an older file recorded, else the documented command here, with "(commit not
recorded)". Nothing here imports a benchmark: only their JSON is read.
"""
import argparse
import json
import re
import sys
from pathlib import Path

from bench import RESULTS, ROOT
from bench.report.tables import RENDERERS, cells_passed, f, pct, rate_name, table

SECTIONS = ("Slow link", "Convergence", "Memory", "Faults", "Communication", "Kernels")
CONV = "python -m bench.convergence --iters 1000 --seed S"

# figure -> section, title, renderer, JSON files (bench/results/), documented command (the fallback
# when a file records none; `commands` per file where a file recorded none or an incomplete one) and
# the renderer's options. Update the commands here when an entry point is renamed.
FIGURES = {
    "slow_link_bf16": dict(section="Slow link", title="ZeRO-3, ZeRO++ and the peers on an emulated link, bf16",
                           render="slow_link", files=["slow_link.json"],
                           command="sudo python -m bench.slow_link --profile"),
    "slow_link_fp32": dict(section="Slow link", title="The same sweep in fp32", render="slow_link",
                           files=["slow_link_fp32.json"], command="sudo python -m bench.slow_link --profile --dtype fp32"),
    "slow_link_reduce_scatter": dict(
        section="Slow link", title="ZeRO-3's reduce-scatter as an all-to-all: ZeRO-3 and ZeRO++, bf16",
        render="slow_link", files=["slow_link_reduce_scatter_final.json"],
        command="sudo python -m bench.slow_link --rates 100,0 --systems zero3-reuse0,zeropp"),
    "slow_link_deltas": dict(section="Slow link", title="ZeRO++ with LoCo and INT4 weight deltas", render="slow_link",
                             files=["slow_link_deltas.json"],
                             command="sudo python -m bench.slow_link --rates 100,200,0 --systems "
                                     "zero3-reuse0,zeropp,zeropp-loco,zeropp-deltas,zeropp-loco-deltas"),
    "slow_link_int2": dict(section="Slow link", title="2-bit gradients and weight deltas", render="slow_link",
                           files=["slow_link_int2.json"],
                           command="sudo python -m bench.slow_link --rates 100,0 --systems zero3-reuse0,"
                                   "zeropp-loco-deltas,zeropp-loco-deltas-int2,zeropp-loco-deltas-int2-all"),
    "slow_link_buckets": dict(section="Slow link", title="The quickstart's model: one bucket against model-sized buckets, fp32",
                              render="slow_link", files=["slow_link_demo_buckets_final_one_bucket.json",
                                                         "slow_link_demo_buckets_final_model_sized.json"],
                              runs={"slow_link_demo_buckets_final_one_bucket.json": "one bucket",
                                    "slow_link_demo_buckets_final_model_sized.json": "model-sized"},
                              command="sudo python -m bench.slow_link --num-layers 4 --hidden 256 --heads 4 --vocab 4096 "
                                      "--seq 128 --micro-batch 8 --dtype fp32 --systems zeropp --rates 100,0 --bucket-fraction F"),
    "slow_link_fsdp2": dict(section="Slow link", title="FSDP2 with the ZeRO++ plug-in, the quickstart's model, bf16",
                            render="slow_link", files=["slow_link_fsdp2_plugin_quiet.json", "slow_link_fsdp2_plugin_quiet_200.json"],
                            runs={"slow_link_fsdp2_plugin_quiet.json": "100 Mbit/s, unthrottled",
                                  "slow_link_fsdp2_plugin_quiet_200.json": "200 Mbit/s"},
                            command="sudo python -m bench.slow_link --num-layers 4 --hidden 256 --heads 4 --vocab 4096 --seq 128 "
                                    "--micro-batch 8 --dtype bf16 --systems fsdp2,fsdp2+zeropp,zeropp,zeropp-loco --rates 100,0 --repeats 2"),
    "slow_link_hsdp": dict(section="Slow link", title="HSDP (replicate across nodes) with the plug-in's INT4 replica all-reduce",
                           render="slow_link", files=["slow_link_hsdp.json", "slow_link_hsdp_fp32.json"],
                           runs={"slow_link_hsdp.json": "bf16", "slow_link_hsdp_fp32.json": "fp32"},
                           command="sudo python -m bench.slow_link sweep --num-layers 4 --hidden 256 --heads 4 --vocab 4096 "
                                   "--seq 128 --micro-batch 2 --dtype bf16 --systems hsdp,hsdp+zeropp --rates 100,0 --repeats 2 "
                                   "(and --dtype fp32)"),
    "slow_link_diloco": dict(section="Slow link", title="Streaming DiLoCo against ZeRO-3 and ZeRO++ + LoCo, bf16",
                             render="slow_link_diloco", baseline="ours ZeRO++ + LoCo",
                             files=["slow_link_diloco.json", "slow_link_diloco_bench_model.json"],
                             runs={"slow_link_diloco.json": "quickstart's model",
                                   "slow_link_diloco_bench_model.json": "slow-link bench's model"},
                             command="sudo python -m bench.slow_link diloco"),
    "slow_link_diloco_tau3": dict(section="Slow link", title="Streaming DiLoCo with a merge delay of 3 at 10 Mbit/s",
                                  render="slow_link_diloco", baseline="ours ZeRO++ + LoCo", files=["slow_link_diloco_tau3.json"],
                                  runs={"slow_link_diloco_tau3.json": "quickstart's model, delay 3"},
                                  command="sudo python -m bench.slow_link diloco --outer-sync-delay 3 --rates 10 --fragments 4 "
                                          "--baselines zeropp-loco"),
    "planner_calibration": dict(section="Slow link", title="The planner's predicted / measured step ms on the emulated link",
                                render="planner_calibration", files=["planner_calibration.json"],
                                command="python -m bench.slow_link planner"),
    "convergence_zeropp": dict(
        section="Convergence", title="ZeRO++ techniques against ZeRO-3: final validation loss and cross-node bytes",
        render="convergence", command=CONV + " --with-loco",
        files=["convergence.json", "convergence_loco_1234.json", "convergence_loco_1235.json",
               "convergence_deltas_1234.json", "convergence_deltas_1235.json", "convergence_hadamard_1234.json",
               "convergence_hadamard_1235.json", "convergence_int2_deltas_1234.json", "convergence_int2_deltas_1235.json",
               "convergence_loco_int8_errors_fp32_1234.json", "convergence_loco_int8_errors_fp32_1235.json",
               "convergence_loco_int8_errors_bf16_1234.json", "convergence_loco_int8_errors_bf16_1235.json",
               "convergence_fsdp2_1234.json", "convergence_fsdp2_1235.json",
               "convergence_hsdp_1234.json", "convergence_hsdp_1235.json"],
        commands={"convergence_hadamard_1234.json": CONV.replace(" S", " 1234") + " --persistence-threshold 1000 --zeropp-flags "
                  "'--zero-stage 3 --zero-quantized-weights --zero-hpz-size 2 --zero-quantized-gradients --zero-hadamard-gradients'",
                  "convergence_hadamard_1235.json": CONV.replace(" S", " 1235") + " --persistence-threshold 1000 --zeropp-flags "
                  "'--zero-stage 3 --zero-quantized-weights --zero-hpz-size 2 --zero-quantized-gradients --zero-hadamard-gradients'"},
        labels={n: {"ZeRO++": "ZeRO++ + Hadamard"} for n in ("convergence_hadamard_1234.json",  # recorded as "ZeRO++"
                                                            "convergence_hadamard_1235.json")}),
    "convergence_int2": dict(
        section="Convergence", title="2-bit gradients: LoCo's err_beta, and INT2 without LoCo (INT2's earlier step)",
        render="convergence", command=CONV + " --tolerance 0.005 --names 'ZeRO-3,ZeRO++ INT2 + LoCo' --zeropp-flags "
        "'--zero-stage 3 --zero-quantized-weights --zero-hpz-size 2 --zero-quantized-gradients --zero-quantized-weight-deltas "
        "--zero-quantized-gradients-bits 2 --bf16 --zero-loco' --baseline-flags '--zero-stage 3 --bf16' --persistence-threshold 1000",
        files=["convergence_int2_loco_1234.json", "convergence_int2_loco_1235.json",
               "convergence_int2_loco_beta08_keep_1234.json", "convergence_int2_loco_beta08_keep_1235.json",
               "convergence_int2_without_loco_1234.json"],
        labels={f"convergence_int2_loco_{s}.json": {"ZeRO++ INT2 + LoCo": "ZeRO++ INT2 + LoCo, err_beta 0.95"}
                for s in (1234, 1235)} | {f"convergence_int2_loco_beta08_keep_{s}.json": {
                    "ZeRO++ INT2 + LoCo": "ZeRO++ INT2 + LoCo, err_beta 0.8"} for s in (1234, 1235)},
        # a run of the INT2 switches alone; its ZeRO-3 baseline is the err_beta 0.8 run's (the same flags)
        baseline_from={"convergence_int2_without_loco_1234.json": ("convergence_int2_loco_beta08_keep_1234.json", "ZeRO-3")}),
    "convergence_diloco": dict(
        section="Convergence", title="Streaming DiLoCo against ZeRO-3: final validation loss",
        render="convergence", bytes=False,  # their inter-node count leaves out the exchanges across groups
        command=CONV + " --names 'ZeRO-3,DiLoCo H=16' --zeropp-flags '--zero-stage 3 "
                       "--outer-sync-interval 16 --outer-fragments 2 --outer-quantization int4'",
        files=["convergence_diloco_h16_1234.json", "convergence_diloco_h16_1235.json",
               "convergence_diloco_h64_warmup100_1234.json", "convergence_diloco_h64_warmup100_1235.json",
               "convergence_diloco_h64_1234.json", "convergence_diloco_h64_1235.json",
               "convergence_diloco_h16_topk2_f01_1234.json", "convergence_diloco_h16_topk2_f01_1235.json",
               "convergence_diloco_h16_topk2_1234.json", "convergence_diloco_h16_topk2_1235.json",
               "convergence_diloco_h16_topk2_errorbuffer_1234.json", "convergence_diloco_h16_topk2_errorbuffer_1235.json"]),
    "train_memory": dict(section="Memory", title="train.py's own peak at 411 M parameters, 8 ranks", render="train_memory",
                         files=["train_memory.json"], command="python -m bench.memory train"),
    "memory_bound": dict(section="Memory", title="Peak RSS against model states and the pools' bounds, 8 ranks as 2 x 4",
                         render="memory_bound", files=["large_model_bound.json", "large_model_bound_deltas.json"],
                         command="python -m bench.memory bound --systems zero3,zeropp"),
    "memory_matrix": dict(section="Memory", title="Every precision, optimizer and budget", render="memory_matrix",
                          files=["large_model_bound_matrix.json", "large_model_bound_matrix_sgd_small.json",
                                 "large_model_bound_matrix_fp16.json", "large_model_bound_matrix_fp16_default.json"],
                          command="python -m bench.memory matrix --num-layers 8 --hidden 2048 --heads 16 "
                                  "--vocab 4096 --seq 32 --world 8 --steps 1"),
    "checkpoint_memory": dict(
        section="Memory", title="A sharded save and load: peak RSS rise per rank, our ZeRO-3 and FSDP2",
        render="checkpoint_memory",
        files=[f"checkpoint_memory_{s}_{d}.json" for s in ("zero", "fsdp2") for d in ("fp32", "bf16")],
        command="python -m bench.memory large --sharding S --dtype D --num-layers 8 --hidden 768 --heads 12 "
                "--vocab 8192 --seq 64 --optimizer adamw --checkpoint DIR"),
    "fault_matrix": dict(section="Faults", title="The fault matrix", render="fault_matrix", files=["fault_matrix.json"],
                         command="python -m scenarios.faults"),
    "groups_job": dict(section="Faults", title="Groups that survive each other", render="groups_job",
                       files=["groups_job.json"], command="python -m scenarios.faults groups"),
    "groups_compressed": dict(section="Faults", title="Groups as jobs with INT4 and topk2 outer gradients",
                              render="groups_job", files=["groups_compressed.json"],
                              command="python -m scenarios.faults groups --cells kill-one-group-int4,"
                                      "kill-one-group-topk2,link-outage-int4,link-outage-topk2"),
    "groups_goodput": dict(section="Faults", title="Groups as jobs: synchronous against --outer-async",
                           render="groups_goodput", files=["groups_goodput.json"],
                           command="python -m bench.groups straggler; python -m bench.groups punisher"),
    "groups_punisher_10min": dict(section="Faults", title="--outer-async under the punisher for 10 minutes",
                                  render="groups_goodput", files=["groups_punisher_10min.json"],
                                  command="python -m bench.groups punisher --modes async --minutes 10 --seeds 1,2"),
    "zeropp_comm": dict(section="Communication", title="Cross-node MiB per iteration per rank, counted as NCCL rings",
                        render="zeropp_comm", files=["zeropp_comm.json"], command="python -m bench.comm"),
    "fsdp2_time_split": dict(section="Communication", title="Where plain FSDP2's step goes on CPU ranks, the quickstart's model",
                             render="fsdp2_time_split", files=["fsdp2_time_split.json"],
                             command="python -m bench.slow_link split"),
    "quant_bench": dict(section="Kernels", title="Quantization kernels", render="quant_bench",
                        files=["quant_bench.json", "quant_bench_cuda.json", "quant_bench_cuda_h200.json"],
                        command="python -m bench.kernels quant --numel 4194304",
                        commands={"quant_bench_cuda.json": "python -m bench.kernels quant --device cuda",
                                  "quant_bench_cuda_h200.json": "python -m bench.kernels quant --device cuda"}),
    "quant_host_cost": dict(section="Kernels", title="The quantizers' host cost in a step, 4 ranks on loopback",
                            render="quant_host_cost", files=["quant_host_cost.json", "quant_host_cost_fp32.json"],
                            command="python -m bench.kernels host-cost",
                            commands={"quant_host_cost_fp32.json": "python -m bench.kernels host-cost --dtype fp32"}),
    "hadamard_cost": dict(section="Kernels", title="Hadamard smoothing's host cost, 2.5 M fp32 elements, blocks of 128",
                          render="hadamard_cost", files=["hadamard_host_cost.json"], command="python -m bench.kernels hadamard"),
}

PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- bench.report: headline -->", "<!-- /bench.report -->"
NOT_RECORDED = "(not recorded)"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def cited_files() -> list:
    """Every JSON file the pages are rendered from."""
    return sorted({n for fig in FIGURES.values() for n in fig["files"]}
                  | {n for fig in FIGURES.values() for n, _ in fig.get("baseline_from", {}).values()})


def _clean(command: str) -> str:
    """A recorded command without its interpreter's path: /x/.venv/bin/python -> python."""
    command = re.sub(r"^\S*/(python3?|torchrun)\b", r"\1", command.strip())
    return "python " + command if command.startswith("bench/") else command


def _load_text(data: dict) -> str:
    if "loadavg_1min_before_after" in data:
        a, b = data["loadavg_1min_before_after"]
        return f"{a:.1f} before, {b:.1f} after (1 min)"
    if isinstance(data.get("loadavg_1min"), list):
        return f"{min(data['loadavg_1min']):.1f}-{max(data['loadavg_1min']):.1f} (1 min, during the run)"
    if "loadavg_1min" in data:
        return f"{data['loadavg_1min']:.1f} (1 min)"
    if "load_average" in data:
        return f"{data['load_average'][0]:.1f} (1 min)"
    loads = [float(m) for u in data.get("uptime", []) for m in re.findall(r"load average: ([\d.]+)", u)]
    if loads:
        return f"{min(loads):.1f}-{max(loads):.1f} (1 min, during the run)"
    return NOT_RECORDED


def provenance(name: str, data: dict, fig: dict) -> dict:
    """Command, commit and machine of one file: its `provenance`, else its old fields, else the registry."""
    if "provenance" in data:
        p, m = data["provenance"], data["provenance"]["machine"]
        return dict(command=p["command"], commit=p["commit"] or "(commit not recorded)", cpu=m["cpu"],
                    capability=m["cpu_capability"], load=f"{m['loadavg_1min']:.1f} (1 min)")
    versions, setup = data.get("versions", {}), data.get("setup", {})
    cells = list(data.get("cells", {}).values())
    command = (fig.get("commands", {}).get(name) or data.get("command") or setup.get("invocation")
               or "` and `".join(dict.fromkeys(c["command"] for c in cells if c.get("command"))) or fig["command"])
    checkout = re.search(r"\(([0-9a-f]{7,40})\)\s*$", data.get("checkout", ""))
    cpu = (data.get("cpu") or data.get("cpu_model") or versions.get("cpu_model") or (cells[0].get("cpu") if cells else None)
           or re.sub(r",\s*torch CPU capability \w+", "", data.get("device_name", "")) or NOT_RECORDED)
    in_name = re.search(r"CPU capability (\w+)", data.get("device_name", ""))
    capability = (data.get("cpu_capability") or data.get("capability") or versions.get("cpu_capability")
                  or (in_name.group(1) if in_name else NOT_RECORDED))
    return dict(command=_clean(command), commit=checkout.group(1) if checkout else "(commit not recorded)",
                cpu=cpu, capability=capability, load=_load_text(data))


def render_figure(key: str, fig: dict) -> list:
    files = [(n, load(n)) for n in fig["files"]]
    for n, data in files:
        if n in fig.get("baseline_from", {}):
            other, run = fig["baseline_from"][n]
            data["summary"] = {run: load(other)["summary"][run], **data["summary"]}
    lines = [f"### {fig['title']}", ""] + RENDERERS[fig["render"]](files, fig) + ["", f"Run it again: `{fig['command']}`", ""]
    for n, data in files:
        p = provenance(n, data, fig)
        lines.append(f"- `bench/results/{n}`: `{p['command']}`; commit {p['commit']}; {p['cpu']}, "
                     f"capability {p['capability']}, load {p['load']}")
    return lines + [""]


def render_page() -> str:
    out = ["# Measured results", "",
           "Generated by `python -m bench.report` from the JSON files in `bench/results/`: do not edit it by hand.",
           "`tests/unit/bench/test_report.py` renders it again and fails when this page differs. Under each table: the",
           "command that wrote each file, its commit and the machine (CPU, torch's CPU capability, load average).", ""]
    for section in SECTIONS:
        out += [f"## {section}", ""]
        for key, fig in FIGURES.items():
            if fig["section"] == section:
                out += render_figure(key, fig)
    return "\n".join(out).rstrip() + "\n"


def _read(name: str) -> dict:
    """A JSON file for the headline: only one that FIGURES cites, so docs/results.md has it too."""
    assert name in cited_files(), f"{name} is not in bench.report.FIGURES"
    return load(name)


def _summary(name: str, run: str):
    return _read(name)["summary"][run]


def _ratio(name, run, base):
    return _summary(name, run)["final_validation_loss"] / _summary(name, base)["final_validation_loss"]


def _seeds(stem, run, base="ZeRO-3"):
    return " / ".join(pct(_ratio(f"{stem}_{s}.json", run, base)) for s in (1234, 1235))


def render_headline() -> str:
    """README's small table: one row per claim, each naming its docs/results.md section."""
    link = lambda s: f"[{s}](docs/results.md#{s.lower().replace(' ', '-')})"
    sl = {(r["system"], r["rate_mbit"]): r for r in _read("slow_link.json")["results"]}
    speed = ", ".join(f"{f(sl[('zeropp', m)]['samples_per_s'] / sl[('zero3-reuse0', m)]['samples_per_s'], 2, 'x')} "
                      f"{'at ' if m else ''}{rate_name(m)}" for m in (100, 200, 1000, 0))
    veth = sl[("zeropp", 100)]["link_bytes_per_step"] / sl[("zero3-reuse0", 100)]["link_bytes_per_step"]
    comm = _read("zeropp_comm.json")["results"][0]
    by = {r["system"]: r["inter_bytes"] / r["plain_inter_bytes"] for r in comm["rows"]}
    dl = {(r["system"], r["rate_mbit"]): r for r in _read("slow_link_diloco.json")["results"]}
    sps = lambda s: dl[(s, 10)].get("samples_per_s_window", dl[(s, 10)]["samples_per_s"])
    dil = " / ".join(f(sps(h) / sps("zeropp-loco"), 2, "x") for h in ("diloco-h16", "diloco-h64"))
    groups = " / ".join(f(dl[(h, 10)]["link_bytes_per_step"] / dl[("zero3", 10)]["link_bytes_per_step"], 4)
                        for h in ("diloco-h16", "diloco-h64"))
    mem = _read("train_memory.json")["rows"]["train.py"]
    bound = [max(r["judge"]["ratio"] for r in s["ranks"]) for s in _read("large_model_bound.json")["systems"].values()]
    cells = [r for n in FIGURES["memory_matrix"]["files"] for r in _read(n)["rows"]]
    fm = _read("fault_matrix.json")
    faults = cells_passed({"engine": fm["layouts"], "modes": fm.get("modes", {})})
    rows = [
        ["ZeRO++ over ZeRO-3 (reuse 0), samples/s, bf16, emulated link", speed, link("Slow link")],
        ["ZeRO++ / ZeRO-3 bytes on the emulated link at 100 Mbit/s", f(veth, 3), link("Slow link")],
        [f"cross-node bytes / ZeRO-3, counted, {comm['world'] // comm['ranks_per_node']} nodes x "
         f"{comm['ranks_per_node']} ranks, {comm['dtype']}: ZeRO++ / + INT4 deltas",
         f"{f(by['ZeRO++ (all three)'], 3)} / {f(by['ZeRO++ + deltas'], 3)}", link("Communication")],
        ["final validation loss vs ZeRO-3, seeds 1234 / 1235: ZeRO++", _seeds("convergence_loco", "ZeRO++"), link("Convergence")],
        ["the same: ZeRO++ + LoCo", _seeds("convergence_loco", "ZeRO++ + LoCo"), link("Convergence")],
        ["the same: ZeRO++ + LoCo + INT4 deltas", _seeds("convergence_deltas", "ZeRO++ + LoCo + deltas"), link("Convergence")],
        ["the same: INT2 gradients and deltas + LoCo, bf16",
         _seeds("convergence_int2_deltas", "ZeRO++ INT2 + LoCo + INT2 deltas"), link("Convergence")],
        ["FSDP2 + plug-in vs plain FSDP2, final validation loss", _seeds("convergence_fsdp2", "FSDP2 + ZeRO++", "FSDP2"),
         link("Convergence")],
        ["HSDP + plug-in (INT4 all-reduce across replicas, LoCo) vs plain HSDP, final validation loss",
         _seeds("convergence_hsdp", "HSDP + ZeRO++", "HSDP"), link("Convergence")],
        ["streaming DiLoCo H=16 vs ZeRO-3, final validation loss", _seeds("convergence_diloco_h16", "DiLoCo H=16"),
         link("Convergence")],
        ["the same, H=64 after a synchronous warm-up of 100 iterations",
         _seeds("convergence_diloco_h64_warmup100", "DiLoCo H=64"), link("Convergence")],
        ["streaming DiLoCo H=16 / H=64: bytes across groups per inner step / ZeRO-3's, on the link", groups,
         link("Slow link")],
        ["streaming DiLoCo H=16 / H=64 over ZeRO++ + LoCo at 10 Mbit/s, samples/s", dil, link("Slow link")],
        ["train.py's rank-0 peak rise / fp32 model, 411 M parameters", f(mem["rise_over_fp32_model"]), link("Memory")],
        ["peak RSS rise / (model states + bounds + activations), worst rank, 417 M parameters: ZeRO-3 / ZeRO++",
         " / ".join(f(b, 3) for b in bound), link("Memory")],
        ["memory matrix cells with peak rise within their limit of the budget",
         f"{sum(bool(r['rss_pass']) for r in cells)} of {len(cells)}", link("Memory")],
        ["fault matrix cells passed", f"{faults[0]} of {faults[1]}", link("Faults")],
    ]
    return "\n".join(table(["what", "measured", "details"], rows)) + "\n"


def _splice(text: str, block: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + "\n" + block + text[end:]


def pages() -> dict:
    """Each generated page's path and the text it should hold."""
    out = {PAGE: render_page()}
    if README.is_file() and BEGIN in README.read_text():
        out[README] = _splice(README.read_text(), render_headline())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each page that differs")
    args = ap.parse_args(argv)
    stale = []
    for path, text in pages().items():
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.relative_to(ROOT).as_posix())
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("out of date (run `python -m bench.report`): " + ", ".join(stale), file=sys.stderr)
    return 1 if stale else 0
