"""DeepSpeed-style config parsing and fp16 loss-scale dynamics (no processes)."""
import pytest

from zeropp.config import ConfigError, DeepSpeedConfig, FP16Config
from zeropp.loss_scaler import LossScaler


def test_deepspeed_defaults_and_sizes():
    cfg = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, "reduce_bucket_size": "5e8",
                                                           "stage3_prefetch_bucket_size": 5e7}})
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000 and z.overlap  # stage 3 overlaps by default
    assert not DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 2}}).zero_optimization.overlap


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimisation": {}}, "unknown key 'zero_optimisation'; did you mean 'zero_optimization'"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "did you mean 'loss_scale_window'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}, "offload_optimizer: optimizer offload"),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "must be a whole number"),
    ({"zero_optimization": {"contiguous_gradients": "yes"}}, "must be true or false"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "need stage 3"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "pick one"),
])
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        DeepSpeedConfig.from_dict(raw)


def test_dynamic_scale_hysteresis_min_and_growth():
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2, loss_scale_window=3,
                              min_loss_scale=4))
    assert s.scale == 16
    s.update(overflow=True)
    assert s.scale == 16           # the first overflow only uses up hysteresis
    s.update(overflow=True)
    assert s.scale == 8
    s.update(overflow=True)
    assert s.scale == 4
    s.update(overflow=True)
    assert s.scale == 4            # never below min_loss_scale
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 8            # `window` clean steps in a row double it
    state = s.state_dict()
    t = LossScaler(FP16Config(enabled=True))
    t.load_state_dict(state)
    assert t.scale == 8 and t.state_dict() == state


def test_static_and_disabled_scales_never_move():
    static = LossScaler(FP16Config(enabled=True, loss_scale=128))
    off = LossScaler(FP16Config(enabled=False))
    for overflow in (True, False, True):
        static.update(overflow)
        off.update(overflow)
    assert static.scale == 128 and off.scale == 1.0
