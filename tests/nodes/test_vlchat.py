"""Vision-language chat (issue 32): a conversation with images encoded as transformers' processor
encodes it (ids and assistant mask), its pixels as the processor preprocesses them, packed whole
with labels only on the assistant's text.

The reference is transformers' own Qwen2-VL processor, built locally (no hub) from zephon's VL chat
tokenizer and an image-processor config with the recipe's vision settings; its
``apply_chat_template(tokenize=True, return_assistant_tokens_mask=True)`` reads the shipped
"chatml_vl_generation" template (with generation markers); zephon is checked with that template and
with "chatml_vl" (none: the mask from prefix renderings). The conversations are a held-out-style
seeded set: multi-turn, several images, images in any turn (an assistant's too), system prompts,
both record forms (the processors' content parts and LLaVA's ``<image>`` markers).
"""

from __future__ import annotations

import io
import json
import random
import re

import numpy as np
import pytest

from zephon.data import BadRecord, ChatRenderer, DataError
from zephon.data.chat import load_chat_template
from zephon.data.chatimages import VL_CHAT_TOKENIZER, parse_vl_conversation
from zephon.data.datasets.samples import MMRecord
from zephon.engine.testing import ListSource
from zephon.nodes import ChatOptions, FetchVisionChat, MMPack, VisionConfig
from zephon.nodes.images import preprocess_patches
from zephon.nodes.vlchat import expand_placeholders
from zephon.nodes.worksource import WorkItem
from zephon.tools.synth import generate_documents, generate_image_text

transformers = pytest.importorskip("transformers")

VISION = VisionConfig(min_pixels=1024, max_pixels=16384, decode="exact")
SPECIAL = {"vision_start": 4098, "vision_end": 4099, "image": 4100, "video": 4101}
WORDS = " ".join(generate_documents("web", 30, seed=7)).split()


class _Index:
    """The little of a dataset index an encoder asks of it (records are given)."""

    name = "vl"

    def locate(self, shard: int, record: int) -> dict:
        return {"file": "vl.parquet", "locator": f"row {record}"}


def _text(rng: random.Random, lo: int = 3, hi: int = 30) -> str:
    start = rng.randrange(len(WORDS) - hi)
    return " ".join(WORDS[start : start + rng.randrange(lo, hi)])


def conversations(n: int, seed: int) -> list[tuple[list[dict], list[bytes]]]:
    """``n`` conversations in the messages form (content parts) and their images, in the order shown."""
    rng = random.Random(seed)
    # sides from 32 pixels (one merged patch): below it, zephon scales an image up first as TorchTitan
    # does, where transformers' Qwen2-VL rounds (test_small_images_follow_torchtitan)
    pool = [s["image"] for s in generate_image_text(64, seed, min_side=32, max_side=160)]
    out = []
    for _ in range(n):
        msgs: list[dict] = []
        images: list[bytes] = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": _text(rng)})
        for turn in range(rng.randrange(1, 4)):
            parts: list[dict] = []
            k = rng.choice([0, 1, 1, 1, 2, 3]) if turn == 0 else rng.choice([0, 0, 0, 1])
            for _ in range(k):
                parts.insert(rng.randrange(len(parts) + 1), {"type": "image"})
                images.append(pool[rng.randrange(len(pool))])
            parts.insert(rng.randrange(len(parts) + 1), {"type": "text", "text": _text(rng)})
            msgs.append({"role": "user", "content": parts})
            answer: list[dict] | str = _text(rng, 1, 40)
            if rng.random() < 0.1:  # an image in the assistant's turn: its placeholders are never targets
                answer = [{"type": "text", "text": answer}, {"type": "image"}]
                images.append(pool[rng.randrange(len(pool))])
            msgs.append({"role": "assistant", "content": answer})
        out.append((msgs, images))
    return out


def as_llava(msgs: list[dict]) -> list[dict]:
    """The same conversation in the LLaVA / ShareGPT form: ``<image>`` markers in the text."""
    who = {"system": "system", "user": "human", "assistant": "gpt"}
    out = []
    for m in msgs:
        c = m["content"]
        text = c if isinstance(c, str) else "".join("<image>" if p["type"] == "image" else p["text"] for p in c)
        out.append({"from": who[m["role"]], "value": text})
    return out


@pytest.fixture(scope="module")
def processor():
    from transformers import PreTrainedTokenizerFast, Qwen2VLProcessor

    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # an older transformers: the PIL one is the default
        from transformers import Qwen2VLImageProcessor as ImageProcessor

    class Processor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, name, arg):  # no video processor (it needs torchvision)
            return None

    tok = PreTrainedTokenizerFast(
        tokenizer_file=f"{VL_CHAT_TOKENIZER}/tokenizer.json", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    images = ImageProcessor(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=VISION.min_pixels,
        max_pixels=VISION.max_pixels,
        image_mean=list(VISION.mean),
        image_std=list(VISION.std),
    )
    marked = load_chat_template("chatml_vl_generation", VL_CHAT_TOKENIZER)
    return Processor(image_processor=images, tokenizer=tok, chat_template=marked, video_processor=None)


def _opened(data: bytes):
    """An image as transformers' ``load_image`` opens a file: its EXIF orientation applied."""
    from PIL import Image, ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)))


def processed(processor, msgs: list[dict], images: list[bytes], template: str | None = None) -> dict:
    """The processor's ids, assistant mask, grids and pixels for a conversation and its images."""

    conv = json.loads(json.dumps(msgs))
    k = 0
    for m in conv:
        if isinstance(m["content"], str):
            m["content"] = [{"type": "text", "text": m["content"]}]
        for p in m["content"]:
            if p["type"] == "image":
                p["image"] = _opened(images[k])
                k += 1
    out = processor.apply_chat_template(
        conv, chat_template=template, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    return {k: np.asarray(v[0] if k in ("input_ids", "assistant_masks") else v) for k, v in out.items()}


#: a template in the style of Qwen2-VL's own (a default system prompt when the conversation has
#: none, a namespace counting the images, "Picture N: " before each with add_vision_id, a part
#: recognised by its type or by an image key): written here, with generation markers
QWEN_STYLE = """{% macro render(content, seen) %}{% if content is string %}{{ content }}{% else %}\
{% for c in content %}{% if c['type'] == 'image' or 'image' in c %}{% set seen.value = seen.value + 1 %}\
{% if add_vision_id %}Picture {{ seen.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>\
{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}{% endmacro %}\
{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and message['role'] \
!= 'system' %}<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}{% if message['role'] == 'assistant' %}<|im_start|>assistant
{% generation %}{{ render(message['content'], image_count) }}<|im_end|>{% endgeneration %}{{ '\\n' }}\
{% else %}<|im_start|>{{ message['role'] }}
{{ render(message['content'], image_count) }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TEMPLATES = {"qwen_style": QWEN_STYLE, "qwen_style_plain": re.sub(r"\{% (end)?generation %\}", "", QWEN_STYLE)}


def encoder(template: str = "chatml_vl_generation", **opts) -> FetchVisionChat:
    text = TEMPLATES.get(template) or load_chat_template(template, VL_CHAT_TOKENIZER)
    renderer = ChatRenderer(VL_CHAT_TOKENIZER, text)
    options = {0: ChatOptions(**({"long": "drop"} | opts))}
    return FetchVisionChat([_Index()], {0: renderer}, options, VISION, SPECIAL, row_len=4096)


def encode(enc: FetchVisionChat, value, images: list[bytes], on_error: str = "raise"):
    enc.on_error = [on_error]
    item = WorkItem(0, 0, 0, 0, 0)
    rec = MMRecord((json.dumps(value), *images), "vl.parquet", "row 0")
    return enc([item], {(0, 0, 0): rec})[0]


SET = conversations(60, seed=32)


@pytest.mark.parametrize("template", ["chatml_vl_generation", "chatml_vl", "qwen_style", "qwen_style_plain"])
@pytest.mark.parametrize("form", ["messages", "sharegpt"])
def test_ids_and_masks_equal_the_processor(processor, template, form):
    enc = encoder(template, format=form)
    marked = QWEN_STYLE if template.startswith("qwen") else None  # the processor reads the marked twin
    equal = 0
    for msgs, images in SET:
        want = processed(processor, msgs, images, marked)
        doc = encode(enc, msgs if form == "messages" else as_llava(msgs), images)
        assert doc.skipped is None
        assert doc.tokens.tolist() == want["input_ids"].tolist()
        assert doc.mask.astype(int).tolist() == want["assistant_masks"].tolist()
        assert doc.grid_thw.tolist() == want.get("image_grid_thw", np.zeros((0, 3))).tolist()
        equal += 1
    assert equal == len(SET) and sum(len(i) for _, i in SET) > 60  # several images a conversation


def test_pixels_equal_the_processors_for_opaque_images(processor):
    """Pixels as image-text samples' (:func:`preprocess_patches`), and equal to the processor's
    (within one float32 ulp) for images without transparency (an image with an alpha channel is
    composited in float by the "exact" decode rule, the processor in 8 bits)."""
    from PIL import Image

    enc = encoder()
    checked = 0
    for msgs, images in SET[:20]:
        doc = encode(enc, msgs, images)
        mine = [preprocess_patches(b, VISION)[0] for b in images]
        assert np.array_equal(doc.pixel_values, np.concatenate(mine) if mine else np.zeros((0, VISION.patch_dim)))
        for b, p in zip(images, mine):
            if Image.open(io.BytesIO(b)).mode in ("RGBA", "LA", "PA"):
                continue
            theirs = processor.image_processor(images=[_opened(b)], return_tensors="np")["pixel_values"]
            assert p.shape == theirs.shape and np.abs(p - theirs).max() <= 2e-7
            checked += 1
    assert checked >= 10


def test_expand_placeholders_moves_the_turns():
    ids = np.array([1, 9, 2, 9, 3, 4])
    out, turns = expand_placeholders(ids, np.array([1, 3]), [2, 3], [(0, 1), (2, 4), (4, 6)])
    assert out.tolist() == [1, 9, 9, 2, 9, 9, 9, 3, 4]
    assert turns == [(0, 1), (3, 7), (7, 9)]


def test_images_and_placeholders_must_agree():
    msgs, images = SET[0]
    enc = encoder()
    with pytest.raises(DataError, match=r"shows \d+ images .* but the record holds"):
        encode(enc, msgs, images + images[:1])
    doc = encode(enc, msgs, images[:-1], on_error="skip")
    assert doc.skipped and "the record holds" in doc.skipped and "vl.parquet" in doc.skipped
    plain = [{"role": "user", "content": "<image>hi"}, {"role": "assistant", "content": "x"}]
    with pytest.raises(DataError, match="renders 0 image placeholders.*chatml_vl"):  # the template's fault: even
        encode(encoder("chatml"), plain, images[:1], on_error="skip")  # under "skip", the run stops


def test_bad_images_and_forged_placeholders_are_bad_records():
    msgs = [{"role": "user", "content": "<image> what?"}, {"role": "assistant", "content": "a cat"}]
    with pytest.raises(DataError, match=r"image #1 of the conversation") as e:
        encode(encoder(), msgs, [b"not an image"])
    assert "vl.parquet" in str(e.value) and "row 0" in str(e.value)
    forged = [{"role": "user", "content": "look <|image_pad|>"}, {"role": "assistant", "content": "no"}]
    with pytest.raises(DataError, match="special token '<\\|image_pad\\|>'"):
        encode(encoder(), forged, [])


def test_a_cut_never_splits_an_image():
    """``truncate`` cuts at a row; a cut inside an image's block moves before the block, and the
    images after the cut are left out with their pixels."""
    img = [s["image"] for s in generate_image_text(4, 1)]
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "two pictures"}, {"type": "image"}]},
        {"role": "assistant", "content": "first " * 20},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and this?"}]},
        {"role": "assistant", "content": "second " * 20},
    ]
    whole = encode(encoder(), msgs, img[:2])
    n = len(whole.tokens)
    start2 = int(np.flatnonzero(whole.tokens == SPECIAL["vision_start"])[1])
    for row in (start2 + 3, n - 5):
        enc = encoder(long="truncate")
        enc.row_len = row
        doc = encode(enc, msgs, img[:2])
        assert len(doc.tokens) <= row and doc.truncated == n - len(doc.tokens)
        k = len(doc.grid_thw)
        assert int((doc.tokens == SPECIAL["image"]).sum()) == int(doc.grid_thw.prod(axis=1).sum()) // 4
        assert k == (1 if row < n - 5 else 2) and len(doc.pixel_values) == int(doc.grid_thw.prod(axis=1).sum())
    enc = encoder(long="drop")
    enc.row_len = n - 1
    assert "conversation too long" in encode(enc, msgs, img[:2]).skipped


def test_packed_labels_are_the_assistant_text_only():
    """Packed whole into rows; labels are -100 on every token that is not the assistant's, and on
    every vision token (an image in the assistant's turn included)."""
    enc = encoder()
    docs = [encode(enc, m, i)._replace(item=WorkItem(0, 0, j, 0, j)) for j, (m, i) in enumerate(SET[:24])]
    row = max(len(d.tokens) for d in docs) + 8
    packer = MMPack(
        ListSource(docs),
        seq_len=row - 1,
        rows=2,
        patch_dim=VISION.patch_dim,
        max_images_per_batch=64,
        ignore_ids=list(SPECIAL.values()),
        mrope=False,
    )
    by_record = dict(enumerate(docs))
    seen = 0
    for batch in packer:
        for r, prov in enumerate(batch["provenance"]):
            pos = 0
            for p in prov:
                d = by_record[p.record]
                assert (p.tok_start, p.tok_end) == (0, len(d.tokens))  # never split
                n = len(d.tokens)
                lab = batch["labels"][r, pos : pos + n - 1]
                want = np.where(d.mask[1:] & ~np.isin(d.tokens[1:], list(SPECIAL.values())), d.tokens[1:], -100)
                assert lab.tolist() == want.tolist()
                pos += n
                seen += 1
    assert seen == len(docs)


def test_the_rendered_view_shows_one_placeholder_per_image():
    msgs, images = SET[1]
    enc = encoder()
    rec = MMRecord((json.dumps(msgs), *images), "vl.parquet", "row 0")
    text = enc.view(0)(rec, "rendered")
    assert text.count("<|image_pad|>") == len(images) and enc.view(0)(rec, "raw") == json.dumps(msgs)
    assert parse_vl_conversation(json.dumps(msgs))["images"] == len(images)


def test_bad_record_from_the_reader_names_it():
    enc = encoder()
    item = WorkItem(0, 0, 3, 0, 3)
    bad = BadRecord("vl", "vl-0.tar", "key 'k3'", "image member 'k3.1.png' is missing")
    with pytest.raises(DataError, match="k3.1.png"):
        enc([item], {(0, 0, 3): bad})


def test_small_images_follow_torchtitan():
    """An image with a side under one merged patch (32 pixels here) is scaled up before the pixel
    budget is applied, as TorchTitan's ``resize_to_pixel_budget`` does (transformers' Qwen2-VL image
    processor rounds it instead: a 68 x 25 image is 2 x 6 patches here, 2 x 4 there); its placeholder
    run always matches its own pixels."""
    from zephon.nodes.images import smart_resize

    assert smart_resize(25, 68, 16, 2, VISION.min_pixels, VISION.max_pixels) == (32, 96)
    small = [s["image"] for s in generate_image_text(12, 5, min_side=12, max_side=31)]
    msgs = [{"role": "user", "content": "<image>" * len(small)}, {"role": "assistant", "content": "small"}]
    doc = encode(encoder(), msgs, small)
    assert int((doc.tokens == SPECIAL["image"]).sum()) * 4 == len(doc.pixel_values) == int(doc.grid_thw.prod(1).sum())


def test_a_dataset_maps_its_roles():
    """``roles`` renames a conversation's roles before every check, in both forms (issue 32)."""
    msgs, images = SET[2]
    want = encode(encoder(), msgs, images)
    renamed = [{**m, "from": {"human": "usr", "gpt": "bot"}.get(m["from"], m["from"])} for m in as_llava(msgs)]
    got = encode(encoder(format="sharegpt", roles={"usr": "user", "bot": "assistant"}), renamed, images)
    assert got.tokens.tolist() == want.tokens.tolist() and got.mask.tolist() == want.mask.tolist()


@pytest.mark.parametrize("placement,rows", [("first_fit", [[0, 2], [1]]), ("best_fit", [[0], [1, 2]])])
def test_mmpack_places_first_or_best_fit(placement, rows):
    """``best_fit`` (``[pack] algorithm = "best_fit"`` from data version 6) puts a sample in the
    fullest row it fits; ``first_fit`` in the first (rows of 10 tokens: 5, then 6 opens row 1,
    then 3 fits both)."""
    from zephon.nodes import MMDoc

    docs = [MMDoc(np.ones(n, np.int32), 0, WorkItem(0, 0, j, 0, j)) for j, n in enumerate((5, 6, 3))]
    packer = MMPack(
        ListSource(docs), seq_len=9, rows=2, patch_dim=12, max_images_per_batch=2, mrope=False, placement=placement
    )
    assert [[p.record for p in row] for row in next(packer)["provenance"]] == rows


def test_a_record_object_holds_its_messages_under_its_text_field():
    msgs, images = SET[3]
    want = encode(encoder(), msgs, images)
    enc = encoder()
    enc.fields = {0: "dialogue"}
    got = encode(enc, {"dialogue": msgs, "id": 7}, images)
    assert got.tokens.tolist() == want.tokens.tolist()
    with pytest.raises(DataError, match="no conversation under 'messages' \\(its keys: 'dialogue'\\).*text_field"):
        encode(encoder(), {"dialogue": msgs}, images)
