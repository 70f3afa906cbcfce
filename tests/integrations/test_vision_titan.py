"""zephon's multimodal batches in TorchTitan 0.3.0's format, checked against its own code.

* resize, patch layout and MRoPE positions equal TorchTitan's ``resize_to_pixel_budget``,
  ``vision_to_patches`` and ``MultiModalCollator._build_mrope_positions``;
* ``ZephonDataLoader`` on a multimodal recipe yields what ``MultiModalCollator`` yields, and the
  Qwen3.5 debug model's ``forward`` accepts it (its ``get_vision_positions`` alignment checks
  included), on CPU.

What cannot run here, precisely: (1) 6 of the debug model's 8 layers are GatedDeltaNet layers,
which call flash-linear-attention's Triton kernels (package ``fla``, CUDA only; not installed);
the forward test replaces them by copies of the model's own full-attention layer (vision encoder,
MRoPE, embeddings and head unchanged) and stubs the ``fla`` import. (2) A training step needs a
backward through FlexAttention, the only attention backend Qwen3.5 offers besides varlen (CUDA):
PyTorch raises "FlexAttention does not support backward on CPU" (asserted below).
TorchTitan's image utilities import torchvision (not installed); only torchvision's import is
stubbed, the functions compared here do not use it.
"""

from __future__ import annotations

import copy
import os
import sys
import types

import numpy as np
import pytest
import torch

pytest.importorskip("torchtitan")

from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe
from zephon.nodes.images import patchify, smart_resize


def _stub(name: str, **attrs) -> None:
    if name in sys.modules:
        return
    try:
        __import__(name)
        return
    except ImportError:
        pass
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _stub_torchvision() -> None:
    _stub("torchvision")
    _stub("torchvision.io")
    _stub("torchvision.transforms")
    _stub("torchvision.transforms.v2")
    _stub("torchvision.transforms.v2.functional")


def _stub_fla() -> None:
    try:
        import fla  # noqa: F401

        return
    except ImportError:
        pass

    class _Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            raise RuntimeError("flash-linear-attention kernels need CUDA")

    def _no(*a, **k):
        raise RuntimeError("flash-linear-attention (GatedDeltaNet) kernels need CUDA")

    for name in [
        "fla",
        "fla.modules",
        "fla.modules.conv",
        "fla.modules.conv.triton",
        "fla.ops",
        "fla.ops.gated_delta_rule",
        "fla.ops.gated_delta_rule.chunk",
        "fla.ops.gated_delta_rule.fused_recurrent",
    ]:
        _stub(name)
    _stub("fla.modules.conv.triton.ops", CausalConv1dFunction=type("CausalConv1dFunction", (_Kernel,), {}))
    _stub("fla.modules.conv.causal_conv1d", causal_conv1d=_no)
    sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = _no
    sys.modules["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule = _no
    sys.modules["fla.ops.gated_delta_rule.chunk"].ChunkGatedDeltaRuleFunction = type(
        "ChunkGatedDeltaRuleFunction", (_Kernel,), {}
    )
    sys.modules["fla.ops.gated_delta_rule.fused_recurrent"].FusedRecurrentFunction = type(
        "FusedRecurrentFunction", (_Kernel,), {}
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return write_vl_root(tmp_path_factory.mktemp("vlt"), seed=1, n_wds=32, n_parquet=16, n_interleaved=12)


@pytest.fixture(scope="module")
def recipe_path(root):
    import json

    cfg = vl_config(root, lanes=4, global_batch_size=8)
    lines = []

    def emit(prefix, d):
        for k, v in d.items():
            if not isinstance(v, (dict, list)) or (isinstance(v, list) and not any(isinstance(x, dict) for x in v)):
                lines.append(f"{k} = {json.dumps(v)}")

    emit("", cfg)
    lines.append('[tokenizer]\npath = "tok"')
    for d in cfg["datasets"]:
        lines.append("[[datasets]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in d.items()]
    for sec in ("vision", "pack", "shuffle"):
        lines.append(f"[{sec}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in cfg[sec].items()]
    path = os.path.join(root, "vl.toml")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def test_resize_and_patches_match_torchtitan():
    _stub_torchvision()
    from torchtitan.hf_datasets.multimodal.utils.image import resize_to_pixel_budget, vision_to_patches

    for h, w in [(24, 96), (96, 24), (33, 47), (200, 300), (1000, 10), (3000, 4000), (17, 1)]:
        for ps, m, lo, hi in [(16, 2, 1024, 4096), (14, 2, 3136, 1003520), (16, 2, 65536, 16777216)]:
            th, tw, _, _ = resize_to_pixel_budget(h, w, patch_size=ps, merge_size=m, min_pixels=lo, max_pixels=hi)
            assert smart_resize(h, w, ps, m, lo, hi) == (th, tw)
    rng = np.random.default_rng(0)
    img = rng.standard_normal((64, 96, 3)).astype(np.float32)
    ours, grid = patchify(img, 16, 2, 2)
    theirs, tgrid = vision_to_patches(torch.from_numpy(img)[None], 16, 2, 2, patch_order="block")
    assert torch.equal(torch.from_numpy(ours), theirs) and grid.tolist() == tgrid.tolist()


def test_loader_output_matches_collator_format_and_mrope(recipe_path):
    _stub_torchvision()
    from torchtitan.hf_datasets.multimodal.mm_collator import MultiModalCollator

    from zephon.integrations.torchtitan import ZephonDataLoader

    loader = ZephonDataLoader.Config(recipe=recipe_path).build(
        dp_world_size=2, dp_rank=1, seq_len=128, local_batch_size=2
    )
    try:
        sp = loader.special_tokens
        assert set(sp) == {"image_id", "video_id", "vision_start_id", "vision_end_id", "pad_id"}
        col = MultiModalCollator.__new__(MultiModalCollator)
        col.spatial_merge_size, col.patch_order = 2, "block"
        n_img = 0
        for _ in range(2 * loader.microbatches_per_step):
            inp, labels = next(loader)
            assert set(inp) == {
                "input",
                "positions",
                "pixel_values",
                "grid_thw",
                "pixel_values_videos",
                "grid_thw_videos",
                "mrope_positions",
                "special_tokens",
            }
            assert inp["input"].shape == labels.shape == (2, 128) and inp["input"].dtype == torch.int64
            if inp["grid_thw"] is None:
                continue
            n_img += len(inp["grid_thw"])
            pv = inp["pixel_values"]
            assert (
                pv.dim() == 3 and pv.shape[0] == len(inp["grid_thw"]) and pv.shape[2] == 1536 and pv.shape[1] % 4 == 0
            )
            ref = col._build_mrope_positions(
                inp["input"],
                inp["grid_thw"],
                None,
                inp["positions"],
                image_token_id=sp["image_id"],
                video_token_id=sp["video_id"],
            )
            assert torch.equal(ref, inp["mrope_positions"])
        assert n_img > 0
    finally:
        loader.close()


def _debug_model(vocab: int):
    _stub_fla()
    import torchtitan.distributed.utils as du
    from torchtitan.models.qwen3_5 import model_registry

    du.set_spmd_backend("partial_dtensor")  # no device mesh outside the trainer
    cfg = model_registry("debugmodel").model
    full = next(layer for layer in cfg.layers if layer.attention is not None)
    cfg.layers = [copy.deepcopy(full) for _ in cfg.layers]  # GatedDeltaNet needs CUDA kernels (see top)
    cfg.vocab_size = vocab
    cfg.tok_embeddings.num_embeddings = vocab
    cfg.lm_head.out_features = vocab
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    return model


@pytest.fixture(scope="module")
def model_and_batch(recipe_path):
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    from zephon.integrations.torchtitan import ZephonDataLoader

    # eager flex attention (the compiled one is the same math; compiling costs ~40 s on 2 cores)
    FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
    loader = ZephonDataLoader.Config(recipe=recipe_path).build(
        dp_world_size=1, dp_rank=0, seq_len=128, local_batch_size=4
    )
    try:
        batches = [next(loader) for _ in range(2)]
    finally:
        loader.close()
    vocab = loader.recipe.prepare().tokenizer.vocab_size
    return _debug_model(vocab), batches, vocab


def test_qwen35_debug_model_forward_on_zephon_batches(model_and_batch):
    from torchtitan.models.common.multimodal import get_vision_positions

    model, batches, vocab = model_and_batch
    for inp, labels in batches:
        kw = {k: v for k, v in inp.items() if k != "input"}
        if inp["grid_thw"] is not None:  # the model's own alignment check (raises on any mismatch)
            n = inp["grid_thw"].prod(-1) // 4
            assert len(get_vision_positions(inp["input"], n, kw["special_tokens"]["image_id"])) == len(n)
        kw["attention_masks"] = model.get_attention_masks(positions=kw["positions"])
        with torch.no_grad():
            logits = model(inp["input"], **kw)
        assert logits.shape == (*inp["input"].shape, vocab) and torch.isfinite(logits).all()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        assert torch.isfinite(loss) and 0 < loss.item() < 20


def test_training_step_needs_flex_attention_backward_which_cpu_lacks(model_and_batch):
    model, batches, _ = model_and_batch
    inp, labels = batches[0]
    kw = {k: v for k, v in inp.items() if k != "input"}
    kw["attention_masks"] = model.get_attention_masks(positions=kw["positions"])
    with pytest.raises(NotImplementedError, match="FlexAttention does not support backward on CPU"):
        logits = model(inp["input"], **kw)
        logits.float().mean().backward()


def test_recipe_multimodal_fingerprint_includes_vision(root):
    a = Recipe.from_dict(vl_config(root), root)
    b = Recipe.from_dict(vl_config(root, vision=dict(vl_config(root)["vision"], max_pixels=8192)), root)
    assert a.data_definition() != b.data_definition()


# -- TorchTitan's CheckpointManager across world sizes, real processes -----------------------------
def _mm_reference(recipe_path: str, steps: int) -> dict:
    """{(step, lane): hash} of an uninterrupted single-process run: per lane, its rows of the
    token fields and mrope_positions, and its images (grid_thw rows and pixel_values patches,
    found from images_per_row), hashed as titan_ckpt_worker.mm_lane_fields hashes them."""
    from zephon import batch_sha256

    rec = Recipe.from_toml(recipe_path)
    rpl = rec.rows_per_lane
    ref = {}
    with rec.global_loader(1) as g:
        for step in range(1, steps + 1):
            b = next(g)
            first = np.concatenate([[0], np.cumsum(b["images_per_row"])])
            pstart = np.concatenate([[0], np.cumsum(b["grid_thw"].prod(axis=1))])
            for lane in range(rec.lanes):
                lo, hi = lane * rpl, (lane + 1) * rpl
                i0, i1 = int(first[lo]), int(first[hi])
                fields = {k: b[k][lo:hi] for k in ("input", "positions", "mrope_positions", "labels")}
                fields["grid_thw"] = b["grid_thw"][i0:i1]
                fields["pixel_values"] = b["pixel_values"][pstart[i0] : pstart[i1]]
                ref[(step, lane)] = batch_sha256(fields)
    return ref


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_checkpoint_manager_multimodal_elastic_resume(recipe_path, tmp_path):
    """TorchTitan's CheckpointManager with the multimodal ZephonDataLoader, torchrun + gloo on CPU:
    W=2 saves after step 2, W=1 resumes for steps 3-4 and saves, W=4 resumes for steps 5-6.
    Every lane's batches (tokens, labels, positions, MRoPE positions, grid_thw, pixel_values)
    equal the uninterrupted single-process run's."""
    from test_titan import _env, _read_hashes, _torchrun

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
    worker = os.path.join(here, "titan_ckpt_worker.py")
    dump, out = tmp_path / "run", tmp_path / "hashes"
    env = _env(tmp_path)
    for W, load, steps in [(2, 0, 2), (1, 2, 2), (4, 4, 2)]:
        _torchrun(
            W,
            [
                worker,
                "--recipe",
                recipe_path,
                "--dump",
                str(dump),
                "--out",
                str(out),
                "--load-step",
                str(load),
                "--steps",
                str(steps),
                "--local-batch-size",
                "2",
                "--multimodal",
            ],
            env,
        )
    got, owners = _read_hashes(str(out))
    ref = _mm_reference(recipe_path, 6)
    lanes = Recipe.from_toml(recipe_path).lanes
    assert set(got) == set(ref) == {(s, l) for s in range(1, 7) for l in range(lanes)}
    bad = [k for k in ref if got[k] != ref[k]]
    assert not bad, f"{len(bad)} lane batches differ, first {bad[0]} at (W, rank) {owners[bad[0]]}"
    assert [owners[(s, lanes - 1)] for s in (2, 3, 5)] == [(2, 1), (1, 0), (4, 3)]
    # the run had images to hash on every world size
    with Recipe.from_toml(recipe_path).global_loader(1) as g:
        assert all(len(next(g)["grid_thw"]) for _ in range(6))


@pytest.mark.slow
def test_vl_chat_batches_in_torchtitans_format_and_model(tmp_path_factory):
    """Conversations with images (issue 32) reach TorchTitan as image-text batches do: MRoPE
    positions equal its collator's, labels only on the assistants' text, and the Qwen3.5 debug
    model's forward (with its image-placeholder alignment check) accepts them."""
    _stub_torchvision()
    from torchtitan.hf_datasets.multimodal.mm_collator import MultiModalCollator
    from torchtitan.models.common.multimodal import get_vision_positions

    from zephon.integrations.torchtitan import ZephonDataLoader
    from zephon.tools.vlchat_demo import write_vl_chat_recipe

    path = write_vl_chat_recipe(str(tmp_path_factory.mktemp("vlchat")), conversations=24)
    loader = ZephonDataLoader.Config(recipe=path).build(dp_world_size=2, dp_rank=1, seq_len=256, local_batch_size=2)
    try:
        sp = loader.special_tokens
        col = MultiModalCollator.__new__(MultiModalCollator)
        col.spatial_merge_size, col.patch_order = 2, "block"
        batches = [next(loader) for _ in range(3 * loader.microbatches_per_step)]
        vocab = loader.recipe.prepare().tokenizer.vocab_size
    finally:
        loader.close()
    n_img = 0
    masked = sum(int((labels == -100).sum()) for _, labels in batches)
    assert 0 < masked < sum(labels.numel() for _, labels in batches)  # users' turns, headers, images
    for inp, _ in batches:
        if inp["grid_thw"] is None:
            continue
        n_img += len(inp["grid_thw"])
        ref = col._build_mrope_positions(
            inp["input"],
            inp["grid_thw"],
            None,
            inp["positions"],
            image_token_id=sp["image_id"],
            video_token_id=sp["video_id"],
        )
        assert torch.equal(ref, inp["mrope_positions"])
        n = inp["grid_thw"].prod(-1) // 4
        assert len(get_vision_positions(inp["input"], n, sp["image_id"])) == len(n)
    assert n_img > 0
    from torch.nn.attention.flex_attention import flex_attention
    from torchtitan.models.common.attention import FlexAttention

    FlexAttention._compiled_flex_attn = staticmethod(flex_attention)
    model = _debug_model(vocab)
    inp, labels = next(b for b in batches if b[0]["grid_thw"] is not None)
    kw = {k: v for k, v in inp.items() if k != "input"}
    kw["attention_masks"] = model.get_attention_masks(positions=kw["positions"])
    with torch.no_grad():
        logits = model(inp["input"], **kw)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
    assert torch.isfinite(loss) and 0 < loss.item() < 20
