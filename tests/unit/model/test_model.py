import math

import pytest
import torch

from model import GPT, GPTConfig, flops_per_iteration, num_parameters
from training.lr_schedule import learning_rate


@pytest.mark.parametrize("kw", [
    dict(vocab_size=50257, num_layers=12, hidden_size=768, num_attention_heads=12),
    dict(vocab_size=1000, num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=100,
         max_position_embeddings=33),
])
def test_parameter_count_matches_built_model(kw):
    cfg = GPTConfig(**kw)
    assert num_parameters(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_gpt2_small_and_18b_sizes():
    assert num_parameters(GPTConfig(vocab_size=50257)) == 124_475_904
    big = GPTConfig(vocab_size=50257, num_layers=40, hidden_size=6144, num_attention_heads=32,
                    max_position_embeddings=512)
    assert 18.0e9 < num_parameters(big) < 18.5e9


def test_vocab_padding_and_tied_output():
    model = GPT(GPTConfig(vocab_size=1000, num_layers=1, hidden_size=32, num_attention_heads=4))
    assert model.wte.weight.shape[0] == 1024
    logits = model(torch.randint(0, 1000, (2, 8)))
    assert logits.shape == (2, 8, 1024)
    model.wte.weight.data.zero_()
    assert model(torch.randint(0, 1000, (1, 4))).abs().max() == 0  # output layer is the embedding


def test_heads_must_divide_hidden():
    with pytest.raises(ValueError, match="--num-attention-heads 5 must divide --hidden-size 64"):
        GPTConfig(hidden_size=64, num_attention_heads=5)


def test_activation_checkpointing_gives_same_gradients():
    torch.manual_seed(0)
    cfg = dict(vocab_size=200, num_layers=2, hidden_size=32, num_attention_heads=4,
               hidden_dropout=0.0, attention_dropout=0.0)
    plain, ckpt = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, checkpoint_activations=True))
    ckpt.load_state_dict(plain.state_dict())
    x = torch.randint(0, 200, (2, 16))
    for m in (plain, ckpt):
        m(x[:, :-1], x[:, 1:]).backward()
    for (n, a), b in zip(plain.named_parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_selective_recompute_gives_same_gradients_with_dropout():
    """--recompute-activations (Megatron's selective recompute): the attention core runs again in
    backward with the same dropout mask, so the gradients are those of the plain model."""
    cfg = dict(vocab_size=200, num_layers=2, hidden_size=32, num_attention_heads=4, attention_dropout=0.2)
    plain, selective = GPT(GPTConfig(**cfg)), GPT(GPTConfig(**cfg, recompute_attention=True))
    selective.load_state_dict(plain.state_dict())
    x = torch.randint(0, 200, (2, 16))
    for m in (plain, selective):
        torch.manual_seed(1)
        m(x[:, :-1], x[:, 1:]).backward()
    for (n, a), b in zip(plain.named_parameters(), selective.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=n)


def test_loss_decreases_over_a_few_steps():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, num_layers=2, hidden_size=32, num_attention_heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (8, 17))
    losses = []
    for _ in range(20):
        loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_flops_formula_recompute_is_larger():
    cfg = GPTConfig(vocab_size=50257, num_layers=40, hidden_size=6144, num_attention_heads=32)
    f = flops_per_iteration(cfg, batch_size=64, seq_length=512, recompute=True)
    B, s, L, h, V = 64, 512, 40, 6144, cfg.padded_vocab_size
    assert f == pytest.approx(96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)))
    assert f > flops_per_iteration(cfg, 64, 512, recompute=False)


def test_lr_schedule_warmup_and_decay():
    kw = dict(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    # Megatron: the first step at the warmup's start, the peak at its last step (inclusive)
    assert learning_rate(0, style="cosine", **kw) == 0.0
    assert learning_rate(1, style="cosine", **kw) == pytest.approx(0.1)
    assert learning_rate(10, style="cosine", **kw) == pytest.approx(1.0)
    assert learning_rate(60, style="cosine", **kw) == pytest.approx(0.55)     # half way: mean of lr and min
    assert learning_rate(60, style="linear", **kw) == pytest.approx(0.55)
    assert learning_rate(35, style="cosine", **kw) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert learning_rate(500, style="linear", **kw) == pytest.approx(0.1)
    assert learning_rate(500, style="constant", **kw) == pytest.approx(1.0)
