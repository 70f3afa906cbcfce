"""zephon.integrations.torch_data: the IterableDataset under StatefulDataLoader.

Real loops: every batch a StatefulDataLoader yields (num_workers 0 and 2) is compared byte for
byte with the native loader's local batch slices; resumes load the loader's own state (same
layout, also in the middle of a step) and a merged state on other world sizes and worker counts.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from zephon import Recipe, StateError
from zephon.integrations.torch_data import ZephonIterableDataset, zephon_state

LANES, SEQ, GBS = 8, 64, 16  # 2 rows per lane per step
FIELDS = ("input", "labels", "positions", "document_ids", "dataset")


def write_small_recipe(root: str) -> str:
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
def recipe(tmp_path_factory):
    r = Recipe.from_toml(write_small_recipe(str(tmp_path_factory.mktemp("torch_data"))))
    r.prepare()
    return r


def native(recipe, W, rank, steps, lbs):
    """The native loader's local batches of rank ``rank``, sliced ``lbs`` rows at a time."""
    out = []
    with recipe.router(W, rank) as r:
        for _ in range(steps):
            b = next(r)
            rows = len(b["input"])
            out.extend({k: b[k][i : i + lbs] for k in FIELDS} for i in range(0, rows, lbs))
    return out


def same(batch, ref):
    for k in FIELDS:
        got = batch[k].numpy()
        assert got.dtype == ref[k].dtype, k
        assert got.tobytes() == np.ascontiguousarray(ref[k]).tobytes(), k


def loader(recipe, W, rank, lbs, workers, state=None):
    ds = ZephonIterableDataset(recipe, world_size=W, rank=rank, local_batch_size=lbs)
    if state is not None and "_snapshot" not in state and "_num_yielded" not in state:
        ds.load_state_dict(state)  # a merged zephon state: before the loader is built
        state = None
    dl = StatefulDataLoader(
        ds, batch_size=lbs, num_workers=workers, multiprocessing_context="fork" if workers else None
    )
    if state is not None:
        dl.load_state_dict(state)
    return dl


@pytest.mark.parametrize("workers", [0, 2])
def test_a_real_loop_gets_the_native_batches(recipe, workers):
    """A plain training loop (tiny model, SGD) over StatefulDataLoader batches; each batch equals
    the native loader's slice byte for byte, loader workers or not."""
    W, rank, lbs = 2, 1, 4
    ref = native(recipe, W, rank, 3, lbs)
    torch.manual_seed(0)
    vocab = recipe.tokenizer.vocab_size
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, 16), torch.nn.Linear(16, vocab))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def loss_of(batch):
        logits = model(torch.as_tensor(batch["input"]))
        labels = torch.as_tensor(batch["labels"]).flatten()
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100)

    def mean_loss_of_the_run():
        # the loss over every batch of the run, on a fixed set of rows: unlike the loss of one step
        # (a different batch each time, so it need not fall step to step) it falls when the model learns
        with torch.no_grad():
            return float(np.mean([float(loss_of(b)) for b in ref]))

    before = mean_loss_of_the_run()
    it = iter(loader(recipe, W, rank, lbs, workers))
    losses = []
    for i in range(len(ref)):
        batch = next(it)
        same(batch, ref[i])
        loss = loss_of(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    after = mean_loss_of_the_run()
    assert np.isfinite(losses).all() and np.isfinite([before, after]).all()
    assert after < before, (before, after)  # the loop trained on these batches


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_from_the_loaders_own_state(recipe, workers):
    """StatefulDataLoader.state_dict() in the middle of a step and at a step boundary, loaded into
    a fresh loader of the same layout: the rest equals the uninterrupted run."""
    W, rank, lbs = 1, 0, 4  # 4 batches per step
    ref = native(recipe, W, rank, 3, lbs)
    for cut in (2, 4, 5):
        dl = loader(recipe, W, rank, lbs, workers)
        it = iter(dl)
        for i in range(cut):
            same(next(it), ref[i])
        state = dl.state_dict()
        del it, dl
        it = iter(loader(recipe, W, rank, lbs, workers, state=state))
        for i in range(cut, cut + 4):
            same(next(it), ref[i])


def test_resume_on_other_world_sizes_and_worker_counts(recipe):
    """W=2 (workers 0 and 2 on the two ranks) saved after 2 steps, merged with zephon_state and
    resumed on W=1 (2 workers) and W=4 (no workers): every rank's batches equal the native ones."""
    lbs = 2
    states = []
    for rank, workers in ((0, 0), (1, 2)):
        dl = loader(recipe, 2, rank, lbs, workers)
        it = iter(dl)
        for _ in range(2 * (GBS // 2 // lbs)):
            next(it)
        states.append(dl.state_dict())
        del it, dl
    merged = zephon_state(states)
    assert merged["step"] == 2
    for W, workers, lb in ((1, 2, 4), (4, 0, 2)):
        for rank in range(W):
            ref = native(recipe, W, rank, 4, lb)[2 * (GBS // W // lb) :]
            it = iter(loader(recipe, W, rank, lb, workers, state=merged))
            for r in ref:
                same(next(it), r)


def test_refusals_name_the_fix(recipe):
    ds = ZephonIterableDataset(recipe, world_size=1, rank=0, local_batch_size=4)
    dl = StatefulDataLoader(ds, batch_size=4, num_workers=3, multiprocessing_context="fork")
    with pytest.raises(ValueError, match=r"num_workers must divide.*num_workers in \[2, 4\]"):
        next(iter(dl))
    with pytest.raises(ValueError, match="does not divide"):
        ZephonIterableDataset(recipe, world_size=2, rank=0, local_batch_size=3)
    dl = loader(recipe, 1, 0, 4, 0)
    it = iter(dl)
    next(it)
    mid = dl.state_dict()
    with pytest.raises(StateError, match="between recipe steps"):
        zephon_state([mid])
    ds = ZephonIterableDataset(recipe, world_size=2, rank=0, local_batch_size=4)
    ds.load_state_dict(mid["fetcher_state"]["dataset_iter_state"])
    with pytest.raises(StateError, match="resumes only on that layout"):
        next(ds)


def test_hf_style_names_and_shifted_labels(recipe):
    ds = ZephonIterableDataset(recipe, world_size=1, rank=0, style="hf")
    row = next(iter(ds))
    assert sorted(row) == ["input_ids", "labels", "position_ids", "shift_labels"]
    ref = native(recipe, 1, 0, 1, GBS)[0]
    assert row["input_ids"].tobytes() == ref["input"][0].tobytes()
    assert row["shift_labels"].tobytes() == ref["labels"][0].tobytes()
    ds.close()
