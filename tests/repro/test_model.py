import torch

from ckptdoctor.check.mova_model import (LORA_TARGETS, TENSORS_PER_DIT_BLOCK, DiTBlock, MOVA, build_model,
                                    tensor_counts)
from ckptdoctor.check.mova_shape import MovaShape


def test_dit_block_has_the_27_tensors_of_a_wan_block():
    names = [n for n, _ in DiTBlock(8, 16, 2).named_parameters()]
    assert len(names) == TENSORS_PER_DIT_BLOCK == 27
    for attn in ("self_attn", "cross_attn"):
        for proj in "qkvo":
            assert f"{attn}.{proj}.weight" in names and f"{attn}.{proj}.bias" in names
        assert f"{attn}.norm_q.weight" in names and f"{attn}.norm_k.weight" in names
    assert {"norm3.weight", "norm3.bias", "ffn.0.weight", "ffn.2.bias", "modulation"} <= set(names)
    assert dict(DiTBlock(8, 16, 2).named_parameters())["modulation"].shape == (1, 6, 8)


def test_real_depths_give_about_3400_trainable_tensors_on_meta():
    with torch.device("meta"):
        model = MOVA(MovaShape.real())
    counts = tensor_counts(model)
    assert counts["video_dit"] == counts["video_dit_2"] == 40 * 27 + 14
    assert 3300 <= counts["total"] - counts["text_encoder"] - counts["video_vae"] - counts["audio_vae"] <= 3500
    ffn_down = dict(model.named_parameters())["video_dit.blocks.0.ffn.2.weight"]
    assert tuple(ffn_down.shape) == (5120, 13824)


def test_sft_trains_the_towers_and_ignores_the_frozen_encoders():
    model, ignored = build_model(MovaShape(), "sft")
    assert ignored == [model.text_encoder, model.video_vae, model.audio_vae]
    trainable = {n.split(".")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"video_dit", "video_dit_2", "audio_dit", "dual_tower_bridge"}


def test_lora_wraps_exactly_the_target_projections_with_rank_16():
    model, ignored = build_model(MovaShape(), "lora")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    wrapped = {n.split(".")[-3] for n in trainable}
    assert wrapped == set(LORA_TARGETS)
    lora_modules = ignored[3:]
    assert len(lora_modules) == len(trainable)
    assert all(m.weight.shape[0] == 16 or m.weight.shape[1] == 16 for m in lora_modules)
    # zero-initialised B: the wrapped model computes what the base computes
    base, _ = build_model(MovaShape(), "sft")
    inputs = (torch.randn(2, 6, 3), torch.randn(2, 5, 2), torch.randint(0, 64, (2, 4)), torch.tensor([0.7, 0.2]))
    torch.manual_seed(5)
    a = base(*inputs)
    torch.manual_seed(5)
    b = model(*inputs)
    assert torch.equal(a, b)


def test_forward_is_deterministic_and_every_tower_gets_gradients():
    model, _ = build_model(MovaShape(), "sft")
    inputs = (torch.randn(2, 6, 3), torch.randn(2, 5, 2), torch.randint(0, 64, (2, 4)), torch.tensor([0.9, 0.1]))
    torch.manual_seed(1)
    loss = model(*inputs)
    loss.backward()
    for tower in model.trainable_towers():
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tower.parameters())
    torch.manual_seed(1)
    assert torch.equal(loss.detach(), model(*inputs).detach())
