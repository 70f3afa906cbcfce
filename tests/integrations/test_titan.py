"""TorchTitan integration: zephon.integrations.torchtitan.ZephonDataLoader.

Fast tests run in-process. ``@pytest.mark.slow`` tests launch real ``torchrun`` processes (gloo
on CPU): TorchTitan's CheckpointManager saving at W=4 and resuming at W=2, 8 and 1, and
TorchTitan's trainer on the llama3 debug model resuming on another DP degree.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torchtitan")
torch = pytest.importorskip("torch")

import zephon  # noqa: E402
from zephon import Recipe, StateError, batch_sha256  # noqa: E402

zt = pytest.importorskip("zephon.integrations.torchtitan")

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")
LANES, SEQ, GBS = 8, 64, 16  # small recipe: 2 rows per lane per step


def _write_small_recipe(root: str) -> str:
    from zephon.tools.demo import DEMO_TOML, TOKENIZER_DIR
    from zephon.tools.synth import make_demo_corpus

    os.makedirs(root, exist_ok=True)
    make_demo_corpus(root, seed=0, scale=0.1)
    text = (
        DEMO_TOML.format(tokenizer=TOKENIZER_DIR.replace("\\", "/"))
        .replace("lanes = 16", f"lanes = {LANES}")
        .replace("seq_len = 256", f"seq_len = {SEQ}")
        .replace("global_batch_size = 32", f"global_batch_size = {GBS}")
        .replace("count = 2", "count = 0")
    )
    path = os.path.join(root, "small.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    return _write_small_recipe(str(tmp_path_factory.mktemp("titan_data")))


def _build(recipe_path, W=1, rank=0, lbs=None, **cfg):
    return zt.ZephonDataLoader.Config(recipe=recipe_path, **cfg).build(
        dp_world_size=W,
        dp_rank=rank,
        tokenizer=None,
        seq_len=SEQ,
        local_batch_size=lbs if lbs is not None else GBS // W,
        snapshot_every_n_steps=1,
    )


def _lane_hashes(batch, first_lane, rows_per_lane, fields=("input", "labels", "positions")):
    """{lane: sha256 of its rows} for a rank's local batch (the named fields, native dtypes)."""
    n = len(batch[fields[0]]) // rows_per_lane
    out = {}
    for j in range(n):
        part = {k: np.asarray(batch[k][j * rows_per_lane : (j + 1) * rows_per_lane]) for k in fields}
        out[first_lane + j] = batch_sha256(part)
    return out


def _reference(recipe_path, steps, fields=("input", "labels", "positions")):
    """{(step, lane): hash} of an uninterrupted single-process run (GlobalLoader, W=1)."""
    rec = Recipe.from_toml(recipe_path)
    ref = {}
    with rec.global_loader(1) as gl:
        for step in range(1, steps + 1):
            for lane, h in _lane_hashes(next(gl), 0, rec.rows_per_lane, fields).items():
                ref[(step, lane)] = h
    return ref


def _take_step(loader):
    """One recipe step through the trainer's eyes: microbatches_per_step next() calls, concatenated."""
    parts = [next(loader) for _ in range(loader.microbatches_per_step)]
    return {
        "input": torch.cat([p[0]["input"] for p in parts]),
        "positions": torch.cat([p[0]["positions"] for p in parts]),
        "labels": torch.cat([p[1] for p in parts]),
    }


def _dcp_merge(states):
    """What DCP does with the ranks' dataloader entries: every key once, from any rank."""
    merged = {}
    for sd in states:
        for k, v in sd.items():
            merged.setdefault(k, v)
    return merged


# -- fast tests ------------------------------------------------------------------------------
def test_import_zephon_does_not_import_torchtitan():
    code = (
        "import sys, zephon, zephon.recipe, zephon.tools.demo, zephon.engine.checkpoint, zephon.tools.cli, zephon.tools.display; "
        "assert 'torchtitan' not in sys.modules, sorted(m for m in sys.modules if 'titan' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_config_contract():
    cfg = zt.ZephonDataLoader.Config(recipe="x.toml", workers=2)
    assert "__slots__" in type(cfg).__dict__
    assert all(f.kw_only for f in dataclasses.fields(cfg) if f.init)
    # TorchTitan's validator rebuilds the dataloader config with `infinite`
    assert dataclasses.replace(cfg, infinite=False).infinite is False
    # no field may collide with the trainer's build() kwargs
    names = {f.name for f in dataclasses.fields(cfg)}
    assert not names & {
        "dp_world_size",
        "dp_rank",
        "tokenizer",
        "seq_len",
        "local_batch_size",
        "snapshot_every_n_steps",
    }


def test_yields_titan_batches(recipe_path):
    loader = _build(recipe_path, W=2, rank=1, lbs=2)
    try:
        assert loader.microbatches_per_step == 4
        inputs, labels = next(loader)
        assert set(inputs) == {"input", "positions"}  # what llama3's Decoder.forward accepts
        for t in (inputs["input"], inputs["positions"], labels):
            assert t.dtype == torch.int64 and tuple(t.shape) == (2, SEQ)
        assert (labels == -100).any() or (labels >= 0).all()
        # the microbatches of one step are the rank's router batch, in order
        rest = [next(loader) for _ in range(3)]
        got = torch.cat([inputs["input"]] + [r[0]["input"] for r in rest])
        router = Recipe.from_toml(recipe_path).router(2, 1)
        try:
            want = next(router)
        finally:
            router.close()
        assert np.array_equal(got.numpy(), want["input"])
        assert np.array_equal(torch.cat([labels] + [r[1] for r in rest]).numpy(), want["labels"])
    finally:
        loader.close()


def test_without_positions(recipe_path):
    loader = _build(recipe_path, W=1, with_positions=False)
    try:
        inputs, _ = next(loader)
        assert set(inputs) == {"input"}
    finally:
        loader.close()


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(W=3, lbs=1), "Run with a DP degree in [1, 2, 4, 8]"),
        (dict(W=2, lbs=3), "--training.local_batch_size to one of [1, 2, 4, 8]"),
        (dict(W=16, lbs=1), "Run with a DP degree in [1, 2, 4, 8]"),
    ],
)
def test_build_errors(recipe_path, kwargs, needle):
    with pytest.raises(ValueError) as e:
        _build(recipe_path, **kwargs)
    assert needle in str(e.value)


def test_seq_len_and_recipe_errors(recipe_path):
    with pytest.raises(ValueError, match=r"Set --training.seq_len 64, or .*--dataloader.recipe_seq_len 128"):
        zt.ZephonDataLoader.Config(recipe=recipe_path).build(
            dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=128, local_batch_size=16
        )
    with pytest.raises(zephon.RecipeError, match="--dataloader.recipe"):
        zt.ZephonDataLoader.Config().build(dp_world_size=1, dp_rank=0, tokenizer=None, seq_len=64, local_batch_size=16)
    with pytest.raises(zephon.RecipeError, match="does not exist"):
        zt.ZephonDataLoader.Config(recipe=recipe_path + ".missing").build(dp_world_size=1, dp_rank=0)


def test_overrides(recipe_path):
    cfg = zt.ZephonDataLoader.Config(
        recipe=recipe_path, workers=2, backend="thread", recipe_seq_len=128, lanes=4, global_batch_size=8, seed=7
    )
    r = cfg.load_recipe()
    assert (r.seq_len, r.lanes, r.global_batch_size, r.seed) == (128, 4, 8, 7)
    w = cfg.worker_override(r)  # reaches every pool, [vision] and [tokenize] included
    assert (w.count, w.backend) == (2, "thread")
    assert zt.ZephonDataLoader.Config(recipe=recipe_path).worker_override(r) is None
    base = Recipe.from_toml(recipe_path)
    # workers are performance only: the data definition (fingerprint) is unchanged
    assert zt.ZephonDataLoader.Config(recipe=recipe_path, workers=2).load_recipe().fingerprint == base.fingerprint


def test_tokenizer_check(recipe_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from zephon.tools.demo import TOKENIZER_DIR

    tok = HuggingFaceTokenizer(tokenizer_path=TOKENIZER_DIR)
    loader = zt.ZephonDataLoader.Config(recipe=recipe_path).build(
        dp_world_size=1, dp_rank=0, tokenizer=tok, seq_len=SEQ, local_batch_size=GBS
    )
    loader.close()

    class Other:
        eos_id = 2

        def get_vocab_size(self):
            return 128256

    with pytest.raises(ValueError, match="--hf_assets_path"):
        zt.ZephonDataLoader.Config(recipe=recipe_path).build(
            dp_world_size=1, dp_rank=0, tokenizer=Other(), seq_len=SEQ, local_batch_size=GBS
        )
    zt.ZephonDataLoader.Config(recipe=recipe_path, check_tokenizer=False).build(
        dp_world_size=1, dp_rank=0, tokenizer=Other(), seq_len=SEQ, local_batch_size=GBS
    ).close()


def test_trainer_global_batch_check(recipe_path, tmp_path):
    """Built from a with_zephon trainer config whose step is not the recipe's global batch (the
    command line changed it): refused, naming the flag."""
    from torchtitan.config import ConfigManager

    def loader_of(*argv):
        cfg = ConfigManager().parse_args(["--module", "titan_launcher", "--config", "zephon_llama3_cpu", *argv])
        assert cfg.dataloader.dump_folder == cfg.dump_folder == dump  # passed on after the command line
        return cfg.dataloader.build(dp_world_size=2, dp_rank=0, tokenizer=None, seq_len=SEQ, local_batch_size=2)

    dump = str(tmp_path / "dump")
    sys.path.insert(0, HERE)
    os.environ["ZEPHON_TEST_RECIPE"] = recipe_path
    try:
        ok = loader_of("--dump_folder", dump, "--training.local_batch_size", "2")
        assert ok.ledger is not None and ok.ledger.path.startswith(os.path.join(dump, "zephon_ledger"))
        ok.close()  # 16 rows = 4 grad-accum steps x 2 rows x 2 ranks = the recipe's global batch
        with pytest.raises(ValueError, match="--training.global_batch_size 16"):
            loader_of("--dump_folder", dump, "--training.global_batch_size", "4")
    finally:
        os.environ.pop("ZEPHON_TEST_RECIPE")
        sys.path.remove(HERE)


@pytest.mark.parametrize("flag", ["dump_folder", "trainer_global_batch_size", "trainer_local_batch_size"])
def test_internal_config_fields_are_not_command_line_flags(recipe_path, flag, capsys):
    """The trainer's facts the config passes to its loader are plumbing, hidden from the command
    line (tyro.conf.Suppress, as TorchTitan's own Trainer.Config.model_spec): not in --help, and
    refused as a flag."""
    from torchtitan.config import ConfigManager

    sys.path.insert(0, HERE)
    os.environ["ZEPHON_TEST_RECIPE"] = recipe_path
    try:
        base = ["--module", "titan_launcher", "--config", "zephon_llama3_cpu"]
        with pytest.raises(SystemExit):
            ConfigManager().parse_args([*base, "--help"])
        shown = capsys.readouterr().out
        assert "--dataloader.recipe" in shown and f"--dataloader.{flag}" not in shown
        with pytest.raises(SystemExit):
            ConfigManager().parse_args([*base, f"--dataloader.{flag}", "7"])
    finally:
        os.environ.pop("ZEPHON_TEST_RECIPE")
        sys.path.remove(HERE)


def test_state_roundtrip_across_world_sizes(recipe_path):
    """Save at W=4 after 2 steps (grad-accum 2), reload the DCP-merged entries at W=2, 8 and 1."""
    ref = _reference(recipe_path, 4)
    W = 4
    loaders = [_build(recipe_path, W=W, rank=r, lbs=2) for r in range(W)]
    try:
        for step in (1, 2):
            for r, ld in enumerate(loaders):
                got = _lane_hashes(_take_step(ld), r * LANES // W, GBS // LANES)
                assert all(ref[(step, lane)] == h for lane, h in got.items())
        states = [ld.state_dict() for ld in loaders]
    finally:
        for ld in loaders:
            ld.close()
    for sd in states:
        assert all(isinstance(v, bytes) for v in sd.values())
        assert sum(k.startswith("lane_") for k in sd) == LANES // W
    assert len({sd["zephon"] for sd in states}) == 1  # shared entry identical on every rank
    merged = _dcp_merge(states)
    for W2, lbs in ((2, 4), (8, 1), (1, 2)):
        new = [_build(recipe_path, W=W2, rank=r, lbs=lbs) for r in range(W2)]
        try:
            for ld in new:
                template = ld.state_dict()  # DCP's template: the keys this rank needs
                ld.load_state_dict({k: merged[k] for k in template})
            for step in (3, 4):
                for r, ld in enumerate(new):
                    got = _lane_hashes(_take_step(ld), r * LANES // W2, GBS // LANES)
                    for lane, h in got.items():
                        assert h == ref[(step, lane)], (W2, step, lane)
        finally:
            for ld in new:
                ld.close()


def test_state_dict_mid_step_refused(recipe_path):
    loader = _build(recipe_path, W=1, lbs=4)
    try:
        next(loader)
        with pytest.raises(StateError, match="--training.global_batch_size 16"):
            loader.state_dict()
        for _ in range(loader.microbatches_per_step - 1):
            next(loader)
        assert "lane_00000" in loader.state_dict()
    finally:
        loader.close()


def test_load_errors(recipe_path):
    src = _build(recipe_path, W=1)
    try:
        next(src)
        sd = src.state_dict()
    finally:
        src.close()
    other_seed = _build(recipe_path, W=2, seed=99)
    try:
        with pytest.raises(StateError, match="seed"):
            other_seed.load_state_dict({k: sd[k] for k in other_seed.state_dict()})
    finally:
        other_seed.close()
    ld = _build(recipe_path, W=2)
    try:
        with pytest.raises(StateError, match="another dataloader"):
            ld.load_state_dict({"dp_rank_0": b"x", "world_size": 2})
        bad = dict(sd)
        bad["lane_00000"] = b"{not json"
        with pytest.raises(StateError, match="lane_00000"):
            ld.load_state_dict(bad)
        ld.load_state_dict({})  # empty: keep a fresh start
        ld.load_state_dict(sd)
        assert ld.step == 1
    finally:
        ld.close()
    more_lanes = _build(recipe_path, W=2, lanes=16, global_batch_size=32, lbs=16)
    try:
        with pytest.raises(StateError, match="lanes"):
            more_lanes.load_state_dict(sd)
    finally:
        more_lanes.close()
    other_data = _build(recipe_path, W=2, global_batch_size=24, lbs=12)  # same lanes and seed, other data
    try:
        with pytest.raises(StateError, match="recipe changed"):
            other_data.load_state_dict({k: sd[k] for k in other_data.state_dict()})
    finally:
        other_data.close()
    newer = dict(sd)
    meta = json.loads(newer["zephon"])
    meta["format_version"] = 99
    newer["zephon"] = json.dumps(meta).encode()
    ld = _build(recipe_path, W=1)
    try:
        with pytest.raises(StateError, match="upgrade zephon"):
            ld.load_state_dict(newer)
    finally:
        ld.close()


def test_model_parallel_peers_identical(recipe_path):
    """Tensor/pipeline-parallel peers build the same dp_rank: same batches, same keys and bytes."""
    a, b = _build(recipe_path, W=2, rank=1, lbs=4), _build(recipe_path, W=2, rank=1, lbs=4)
    try:
        for _ in range(4):
            (ia, la), (ib, lb) = next(a), next(b)
            assert torch.equal(ia["input"], ib["input"]) and torch.equal(la, lb)
        assert a.state_dict() == b.state_dict()
    finally:
        a.close()
        b.close()


def test_config_function_and_cli(recipe_path, monkeypatch):
    from torchtitan.config import ConfigManager

    import zephon.integrations.torchtitan_demo as zdemo

    monkeypatch.setattr(zdemo, "demo_recipe_path", lambda root=None: recipe_path)
    cfg = ConfigManager().parse_args(
        [
            "--module",
            "zephon.integrations.torchtitan_demo",
            "--config",
            "zephon_llama3_debug",
            "--dataloader.workers",
            "3",
            "--training.local_batch_size",
            "4",
        ]
    )
    assert isinstance(cfg.dataloader, zt.ZephonDataLoader.Config)
    assert cfg.dataloader.workers == 3 and cfg.dataloader.recipe == "demo"
    assert (cfg.training.seq_len, cfg.training.global_batch_size, cfg.training.local_batch_size) == (SEQ, GBS, 4)
    assert cfg.model_spec.model.vocab_size == 4096 and cfg.checkpoint.last_save_model_only is False


def test_with_zephon_on_any_model_config(recipe_path):
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    cfg = zt.with_zephon(qwen3_debugmodel(), recipe_path, workers=1)
    assert cfg.dataloader.recipe == recipe_path and cfg.dataloader.workers == 1
    assert (cfg.training.seq_len, cfg.training.global_batch_size) == (SEQ, GBS)
    assert GBS % cfg.training.local_batch_size == 0


# -- validation on a finite recipe, and the batch ledger (in-process) ------------------------
VAL_TOML = """\
seed = 5
lanes = {lanes}
seq_len = {seq}
global_batch_size = {gbs}
cache_dir = "cache"

[tokenizer]
path = "{tok}"

[[datasets]]
name = "heldout"
path = "web/*.jsonl"
format = "jsonl"
policy = "stop"

[shuffle]
buffer = 1

[workers]
count = 0
"""


@pytest.fixture(scope="module")
def val_path(recipe_path):
    from zephon.tools.demo import TOKENIZER_DIR

    path = os.path.join(os.path.dirname(recipe_path), "val.toml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(VAL_TOML.format(lanes=LANES, seq=SEQ, gbs=GBS, tok=TOKENIZER_DIR))
    return path


def _drain(loader):
    """next() until StopIteration, as TorchTitan's validator with steps = -1 does: the batches."""
    out = []
    while True:
        try:
            out.append(next(loader))
        except StopIteration:
            return out


def test_validation_loader_same_rows_and_steps_on_every_world_size(val_path):
    """A finite recipe as validator.dataloader (infinite = False): on W = 1, 2, 4 every rank makes the
    same number of next() calls, all stop on the same call, and the global batches are the same."""
    lbs = 2  # the validator asks for training.local_batch_size rows per next()
    ref = None
    for W in (1, 2, 4):
        loaders = [_build(val_path, W=W, rank=r, lbs=lbs, infinite=False) for r in range(W)]
        per_rank = [_drain(ld) for ld in loaders]
        calls = [len(b) for b in per_rank]
        assert len(set(calls)) == 1, f"W={W}: ranks stopped after {calls} next() calls"
        per_step = calls[0] // loaders[0].microbatches_per_step
        steps = []
        for t in range(per_step):
            rows = []
            for b in per_rank:  # rank order = lane order
                m = loaders[0].microbatches_per_step
                rows += [b[t * m + i] for i in range(m)]
            steps.append(
                batch_sha256(
                    {
                        "input": torch.cat([x[0]["input"] for x in rows]).numpy(),
                        "labels": torch.cat([x[1] for x in rows]).numpy(),
                    }
                )
            )
        for ld in loaders:
            with pytest.raises(StopIteration):  # stays ended
                next(ld)
        states = [ld.state_dict() for ld in loaders]  # works after the end (the workers are closed)
        assert len({sd["zephon"] for sd in states}) == 1
        ref = ref or (steps, _dcp_merge(states))
        assert steps == ref[0], f"W={W}"
    # the end state resumes ended on another W
    ld = _build(val_path, W=8, rank=3, lbs=lbs, infinite=False)
    ld.load_state_dict({k: ref[1][k] for k in ld.state_dict()})
    with pytest.raises(StopIteration):
        next(ld)
    ld.close()


def test_a_finite_pass_needs_a_finite_recipe(recipe_path):
    with pytest.raises(ValueError, match=r"validator.steps = -1\) but the recipe .* never ends: dataset \'web\'"):
        _build(recipe_path, W=2, infinite=False)


def test_with_zephon_validation(recipe_path, val_path, tmp_path):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = zt.with_zephon(llama3_debugmodel(), recipe_path, validation=val_path, local_batch_size=2, workers=1)
    v = cfg.validator
    assert v.enable and v.steps == -1 and isinstance(v.dataloader, zt.ZephonDataLoader.Config)
    assert (v.dataloader.recipe, v.dataloader.ledger, v.dataloader.workers) == (val_path, False, 1)
    with pytest.raises(ValueError, match="validation recipe .* never ends"):
        zt.with_zephon(llama3_debugmodel(), recipe_path, validation=recipe_path)
    other = tmp_path / "val128.toml"
    other.write_text(open(val_path).read().replace(f"seq_len = {SEQ}", "seq_len = 128"))
    with pytest.raises(ValueError, match="seq_len = 128, the training recipe 64"):
        zt.with_zephon(llama3_debugmodel(), recipe_path, validation=str(other))
    with pytest.raises(ValueError, match="local_batch_size = 3 rows per next"):
        zt.with_zephon(llama3_debugmodel(), recipe_path, validation=val_path, local_batch_size=3)


def test_the_loader_writes_a_ledger_that_zephon_hashes_reproduces(recipe_path, tmp_path):
    import io

    from zephon.tools.cli import run_hashes
    from zephon.tools.ledger import read_ledger, run_ledger_show

    folder = str(tmp_path / "ledger")
    loaders = [_build(recipe_path, W=2, rank=r, lbs=4, ledger_dir=folder) for r in range(2)]
    for _ in range(3):
        for ld in loaders:
            _take_step(ld)
    merged = _dcp_merge([ld.state_dict() for ld in loaders])
    for ld in loaders:
        ld.close()
    resumed = _build(recipe_path, W=1, lbs=8, ledger_dir=folder)  # a resume on W=1 appends
    resumed.load_state_dict({k: merged[k] for k in resumed.state_dict()})
    for _ in range(2):
        _take_step(resumed)
    resumed.close()
    shown, ref = io.StringIO(), io.StringIO()
    run_ledger_show(folder, out=shown)
    run_hashes(Recipe.from_toml(recipe_path), world_size=4, steps=5, digest="ledger", out=ref)
    assert shown.getvalue() == ref.getvalue() and shown.getvalue().count("\n") == 5
    led = read_ledger(folder)
    assert [r["world_size"] for r in led.runs] == [2, 2, 1] and led.recipe().fingerprint == led.fingerprints[0]
    # no ledger outside a trainer unless a folder is given, and none when turned off
    for kw in ({}, {"ledger": False, "ledger_dir": folder}):
        ld = _build(recipe_path, W=1, **kw)
        assert ld.ledger is None
        ld.close()


# -- slow tests: real processes --------------------------------------------------------------
def _env(tmp_path, **extra):
    env = dict(os.environ)
    env.update(
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",
        ZEPHON_CACHE_DIR=str(tmp_path / "zcache"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_DATASETS_CACHE=str(tmp_path / "hfcache"),
        PYTHONPATH=os.pathsep.join([HERE, env.get("PYTHONPATH", "")]),
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _torchrun(W, script_args, env, timeout=400, check=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={W}"] + script_args
    p = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"torchrun W={W} failed (rc {p.returncode}):\n{p.stdout[-6000:]}")
    return p


def _read_hashes(folder):
    """{(step, lane): hash} from every rank's hashes file; each (step, lane) written once."""
    out, owners = {}, {}
    for path in glob.glob(os.path.join(folder, "hashes_rank*.jsonl")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                for lane, h in rec["lanes"].items():
                    key = (rec["step"], int(lane))
                    assert key not in out, f"{key} delivered twice"
                    out[key] = h
                    owners[key] = (rec["dp_world_size"], rec["dp_rank"])
    return out, owners


def _read_losses(folder, key="loss"):
    with open(os.path.join(folder, "loss_rank0.jsonl"), encoding="utf-8") as f:
        return {r["step"]: r[key] for r in map(json.loads, f)}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_checkpoint_manager_elastic_resume(recipe_path, tmp_path):
    """TorchTitan's CheckpointManager: save at W=4 after step 3; resume at W=2 (async saves),
    then W=8, then W=1; every rank's batches equal the uninterrupted run's."""
    dump, out = tmp_path / "run", tmp_path / "hashes"
    env = _env(tmp_path)
    worker = os.path.join(HERE, "titan_ckpt_worker.py")
    chain = [(4, 0, 3, []), (2, 3, 2, ["--async"]), (8, 5, 2, []), (1, 7, 2, [])]
    for W, load, steps, extra in chain:
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
            ]
            + extra,
            env,
        )
    got, owners = _read_hashes(str(out))
    ref = _reference(recipe_path, 9)
    assert set(got) == set(ref)
    bad = [k for k in ref if got[k] != ref[k]]
    assert not bad, f"{len(bad)} lane batches differ, first {bad[0]} at (W, rank) {owners[bad[0]]}"
    assert {owners[(s, 0)][0] for s in range(1, 10)} == {4, 2, 8, 1}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_llama3_elastic_resume(recipe_path, tmp_path):
    """TorchTitan's trainer, llama3 debug model: W=2 with checkpoints, resume at W=1, then W=4.
    Per-lane (hence global) batch hashes equal the uninterrupted W=2 run's at every step, and the
    losses match it to 1e-3."""
    launcher = os.path.join(HERE, "titan_launcher.py")
    base = ["--module", "titan_launcher", "--config", "zephon_llama3_cpu"]
    ref_dump, ref_out = tmp_path / "ref", tmp_path / "ref_out"
    _torchrun(
        2,
        [launcher] + base + ["--dump_folder", str(ref_dump), "--training.steps", "6"],
        _env(tmp_path, ZEPHON_TEST_RECIPE=recipe_path, ZEPHON_TEST_OUT=ref_out),
    )
    # the elastic run: the uninterrupted run's step-2 checkpoint, then W=1 to step 4, W=4 to 6
    el_dump, el_out = tmp_path / "elastic", tmp_path / "el_out"
    shutil.copytree(ref_dump / "checkpoint" / "step-2", el_dump / "checkpoint" / "step-2")
    env = _env(tmp_path, ZEPHON_TEST_RECIPE=recipe_path, ZEPHON_TEST_OUT=el_out)
    _torchrun(1, [launcher] + base + ["--dump_folder", str(el_dump), "--training.steps", "4"], env)
    _torchrun(4, [launcher] + base + ["--dump_folder", str(el_dump), "--training.steps", "6"], env)

    ref_hashes, _ = _read_hashes(str(ref_out))
    el_hashes, owners = _read_hashes(str(el_out))
    fields = ("dataset", "document_ids", "input", "labels", "positions")
    gl = _reference(recipe_path, 6, fields=fields)
    assert ref_hashes == gl  # the trainer's W=2 run is the uninterrupted single-process stream
    assert set(el_hashes) == {(s, l) for s in range(3, 7) for l in range(LANES)}
    assert all(el_hashes[k] == ref_hashes[k] for k in el_hashes)
    assert {owners[(3, 0)][0], owners[(5, 0)][0]} == {1, 4}
    ref_loss, el_loss = _read_losses(str(ref_out)), _read_losses(str(el_out))
    diffs = {s: abs(el_loss[s] - ref_loss[s]) for s in range(3, 7)}
    ref_gn, el_gn = _read_losses(str(ref_out), "grad_norm"), _read_losses(str(el_out), "grad_norm")
    print("loss diffs vs uninterrupted W=2:", diffs, "grad-norm diffs:", {s: abs(el_gn[s] - ref_gn[s]) for s in diffs})
    assert max(diffs.values()) < 1e-3, diffs

    # the batch ledgers the trainer's loader wrote: the uninterrupted run's equals `zephon hashes
    # --digest ledger`; the elastic run's two launches (W=1, then W=4) appended to one ledger
    import io

    from zephon.tools.cli import run_hashes
    from zephon.tools.ledger import read_ledger

    expected = run_hashes(Recipe.from_toml(recipe_path), steps=6, digest="ledger", out=io.StringIO())
    ref_led, el_led = read_ledger(str(ref_dump)), read_ledger(str(el_dump))
    assert [ref_led.digest(b) for b in ref_led.batches()] == expected
    assert el_led.batches() == [2, 3, 4, 5] and not el_led.conflicts
    assert [el_led.digest(b) for b in el_led.batches()] == expected[2:]
    assert sorted({r["world_size"] for r in el_led.runs}) == [1, 4] and len(el_led.runs) == 5
    assert {r["start_batch"] for r in el_led.runs} == {2, 4}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_titan_own_loader_cannot_resume_on_other_dp_degree(recipe_path, tmp_path):
    """Contrast: TorchTitan's HuggingFaceTextDataLoader, saved at W=2, refuses to resume at W=1."""
    launcher = os.path.join(HERE, "titan_launcher.py")
    base = ["--module", "titan_launcher", "--config", "titan_loader_cpu"]
    data = os.path.join(os.path.dirname(recipe_path), "web")
    dump = tmp_path / "titan"
    env = _env(tmp_path, ZEPHON_TEST_RECIPE=recipe_path, ZEPHON_TEST_HF_DATA=data, ZEPHON_TEST_OUT=tmp_path / "out")
    _torchrun(2, [launcher] + base + ["--dump_folder", str(dump), "--training.steps", "2"], env)
    p = _torchrun(1, [launcher] + base + ["--dump_folder", str(dump), "--training.steps", "3"], env, check=False)
    assert p.returncode != 0
    assert "dp_degree is inconsistent before and after checkpoint" in p.stdout


def test_metrics_are_logged_every_n_steps(recipe_path, caplog):
    import logging

    ld = _build(recipe_path, W=2, rank=1, log_every=2)
    try:
        with caplog.at_level(logging.INFO, logger="zephon"):
            for _ in range(4):
                _take_step(ld)
        lines = [r.getMessage() for r in caplog.records if r.name == "zephon"]
        assert len(lines) == 2 and lines[0].startswith("zephon rank 1: step 2;") and "Pack" in lines[0]
        assert "packing" in lines[1] and ld.metrics()["Batch"]["items"] >= 4 * 4
    finally:
        ld.close()


def test_the_loader_ledger_records_filtered_documents(recipe_path, tmp_path):
    """A filtered recipe's ledger, written by the trainer's loader on W=2, records per lane the
    documents its filters dropped, as ``zephon hashes --ledger`` on W=1 computes them."""
    import io

    from zephon.tools.cli import run_hashes
    from zephon.tools.ledger import read_ledger

    path = os.path.join(os.path.dirname(recipe_path), "filtered.toml")  # beside it: the same data
    with open(recipe_path, encoding="utf-8") as f, open(path, "w", encoding="utf-8") as out:
        out.write(
            f.read() + '\n[[filters]]\nname = "no-the"\nkind = "regex"\npattern = "\\\\bthe\\\\b"\ndatasets = ["web"]\n'
        )
    folder, ref = str(tmp_path / "ledger"), str(tmp_path / "ref")
    loaders = [_build(path, W=2, rank=r, lbs=4, ledger_dir=folder) for r in range(2)]
    for _ in range(4):
        for ld in loaders:
            _take_step(ld)
    for ld in loaders:
        ld.close()
    run_hashes(Recipe.from_toml(path), world_size=1, steps=4, out=io.StringIO(), ledger=ref)
    got, want = read_ledger(folder), read_ledger(ref)
    counts = {(b, l): got.filtered(b, l) for b in range(4) for l in range(LANES)}
    assert counts == {(b, l): want.filtered(b, l) for b in range(4) for l in range(LANES)}
    assert sum(c.get("no-the/web", 0) for c in counts.values()) > 0
