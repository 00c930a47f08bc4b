"""Tests for megatron_edit.cpu.data: the local corpus, the byte tokenizer, and megatron-core's GPT
datasets built over it (single process, CPU)."""

import hashlib
import os
import subprocess
import sys

import numpy
import pytest
import torch

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron_edit.cpu import data

SEQ_LENGTH = 64
NUM_SAMPLES = (512, 32, 16)


@pytest.fixture(scope="module")
def corpus() -> str:
    return data.build_corpus()


@pytest.fixture(scope="module")
def prefix(tmp_path_factory) -> str:
    return data.prepare_indexed_dataset(str(tmp_path_factory.mktemp("data") / "docs"))


@pytest.fixture(scope="module")
def datasets(prefix):
    return data.build_gpt_datasets(prefix, SEQ_LENGTH, NUM_SAMPLES, seed=1234)


def test_compiled_dataset_helpers_import():
    from megatron.core.datasets import helpers_cpp

    assert hasattr(helpers_cpp, "build_sample_idx_int32")


def test_corpus_is_substantial_english_text(corpus):
    raw = corpus.encode("utf-8")
    assert len(raw) > 200_000
    assert sum(b > 127 for b in raw) / len(raw) < 0.001
    letters = sum(c.isascii() and c.isalpha() for c in corpus)
    assert letters / len(corpus) > 0.6
    assert "Return" in corpus and "argparse.ArgumentParser" in corpus


def test_corpus_is_deterministic(corpus):
    assert data.build_corpus() == corpus
    # A fresh interpreter with another hash seed, without torch imported first, and without
    # pytest (whose debugging plugin replaces pdb.set_trace, documented since 3.12).
    script = (
        "import hashlib; from megatron_edit.cpu import data; "
        "print(hashlib.sha256(data.build_corpus().encode()).hexdigest())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == hashlib.sha256(corpus.encode()).hexdigest()


# sha256 of build_corpus() per CPython minor version: its standard library's docstrings are the
# text, so each minor version has its own corpus (the same on every build of it). To add a
# version: run the command in the skip message on it and check the text looks like the others.
CORPUS_SHA256 = {
    (3, 11): "0d17ed9d469c40b764896278be94f72560f5634f74f4f6cca89d8275bd4123a8",
    (3, 12): "e66fb13d79bad32825859ed39e704674e3e95c37c017b402a44dc017948c59f2",
}


def test_corpus_is_the_known_text_of_this_python(corpus):
    """The corpus is pinned per Python minor version: a change to the module list, the
    normalisation or the selection of docstrings shows here (and would silently change the main
    job's data and every figure measured on it)."""
    expected = CORPUS_SHA256.get(sys.version_info[:2])
    if expected is None:
        pytest.skip(f"no pinned corpus for Python {sys.version_info[0]}.{sys.version_info[1]}: add "
                    "the output of python -c \"import hashlib; from megatron_edit.cpu import data; "
                    "print(hashlib.sha256(data.build_corpus().encode()).hexdigest())\"")
    assert hashlib.sha256(corpus.encode()).hexdigest() == expected


def test_corpus_budget_gives_a_prefix(corpus):
    small = data.build_corpus(max_bytes=50_000)
    assert 40_000 < len(small.encode("utf-8")) <= 50_000
    assert corpus.startswith(small + data.DOCUMENT_SEPARATOR)


def test_documents_join_to_corpus(corpus):
    documents = data.build_documents()
    assert len(documents) > 1000
    assert all(data.DOCUMENT_SEPARATOR not in d and d == d.strip() for d in documents)
    assert data.DOCUMENT_SEPARATOR.join(documents) == corpus


def test_tokenizer_round_trips():
    text = "Return the sum of a and b.\n\n\tcafé ≠ 1 — ok"
    ids = data.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert data.decode(ids) == text
    assert data.decode(data.encode("ab") + [data.EOD_ID] + data.encode("cd")) == (
        "ab" + data.DOCUMENT_SEPARATOR + "cd"
    )

    tokenizer = data.ByteTokenizer()
    assert tokenizer.vocab_size == data.VOCAB_SIZE == 257
    assert tokenizer.eod == data.EOD_ID < data.VOCAB_SIZE
    assert len(tokenizer.vocab) == data.VOCAB_SIZE
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text
    assert not hasattr(tokenizer, "pad")


def test_indexed_dataset_holds_one_document_per_corpus_document(prefix):
    documents = data.build_documents()
    indexed = IndexedDataset(prefix)
    assert len(indexed) == len(documents)
    assert indexed.index.dtype == numpy.uint16
    for i in (0, len(documents) // 2, len(documents) - 1):
        ids = indexed[i].tolist()
        assert ids[-1] == data.EOD_ID
        assert data.decode(ids[:-1]) == documents[i]
    assert not [name for name in os.listdir(os.path.dirname(prefix)) if ".tmp-" in name]


def test_prepare_is_idempotent_and_rebuilds_on_other_budget(tmp_path):
    prefix = str(tmp_path / "docs")
    data.prepare_indexed_dataset(prefix, max_bytes=30_000)
    stamps = [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx", ".json")]
    data.prepare_indexed_dataset(prefix, max_bytes=30_000)
    assert [os.stat(prefix + ext).st_mtime_ns for ext in (".bin", ".idx", ".json")] == stamps

    data.prepare_indexed_dataset(prefix, max_bytes=60_000)
    assert len(IndexedDataset(prefix)) == len(data.build_documents(60_000))

    # A truncated .bin is not taken for complete.
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    data.prepare_indexed_dataset(prefix, max_bytes=60_000)
    assert len(IndexedDataset(prefix)) == len(data.build_documents(60_000))


def test_gpt_samples_have_megatron_layout(datasets):
    for dataset, requested in zip(datasets, NUM_SAMPLES):
        assert len(dataset) >= requested
        sample = dataset[len(dataset) - 1]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        for value in sample.values():
            assert value.shape == (SEQ_LENGTH,)
        assert sample["tokens"].dtype == sample["labels"].dtype == torch.int64
        assert torch.equal(sample["tokens"][1:], sample["labels"][:-1])
        assert torch.equal(sample["position_ids"], torch.arange(SEQ_LENGTH))
        assert torch.equal(sample["loss_mask"], torch.ones(SEQ_LENGTH))
        assert int(sample["tokens"].max()) < data.VOCAB_SIZE


def test_gpt_samples_are_corpus_text(datasets, corpus):
    raw = corpus.encode("utf-8")
    train = datasets[0]
    for i in range(0, len(train), 97):
        sample = train[i]
        ids = sample["tokens"].tolist() + sample["labels"][-1:].tolist()
        pieces, current = [], []
        for token in ids:
            if token == data.EOD_ID:
                pieces.append(current)
                current = []
            else:
                current.append(token)
        pieces.append(current)
        for piece in pieces:
            assert bytes(piece) in raw


def test_two_builds_give_identical_samples(tmp_path, datasets):
    other_prefix = data.prepare_indexed_dataset(str(tmp_path / "docs"))
    rebuilt = data.build_gpt_datasets(other_prefix, SEQ_LENGTH, NUM_SAMPLES, seed=1234)
    for first, second in zip(datasets, rebuilt):
        assert len(first) == len(second)
        for i in range(0, len(first), 7):
            assert torch.equal(first[i]["tokens"], second[i]["tokens"])

    reseeded = data.build_gpt_datasets(other_prefix, SEQ_LENGTH, NUM_SAMPLES, seed=4321)
    assert not torch.equal(datasets[0][0]["tokens"], reseeded[0][0]["tokens"])


def test_batch_iterator_strides_over_ranks(datasets):
    train = datasets[0]
    micro_batch_size, world_size = 3, 2
    per_rank = [list(data.batch_iterator(train, micro_batch_size, r, world_size)) for r in (0, 1)]

    assert len(per_rank[0]) == len(train) // (micro_batch_size * world_size)
    for rank, batches in enumerate(per_rank):
        for step in (0, len(batches) - 1):
            indices = data.batch_sample_indices(step, micro_batch_size, rank, world_size)
            assert indices == [rank + (step * micro_batch_size + j) * world_size for j in range(3)]
            expected = torch.stack([train[i]["tokens"] for i in indices])
            assert torch.equal(batches[step]["tokens"], expected)
            assert batches[step]["labels"].shape == (micro_batch_size, SEQ_LENGTH)

    # Step 0 of both ranks together covers global samples 0..5 exactly once.
    seen = torch.cat([per_rank[0][0]["tokens"], per_rank[1][0]["tokens"]])
    expected = torch.stack([train[i]["tokens"] for i in (0, 2, 4, 1, 3, 5)])
    assert torch.equal(seen, expected)

    with pytest.raises(ValueError):
        next(data.batch_iterator(train, 0))
