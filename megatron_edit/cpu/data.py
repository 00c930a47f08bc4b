"""Local text data for the CPU demo and the tests: corpus, byte tokenizer, Megatron GPT datasets.

The demo trains a small GPT with EDiT on real English text, but this project may never download
anything. The text therefore comes from the machine itself: the docstrings of a fixed list of
CPython standard-library modules, which every install of one CPython minor version carries byte
for byte (3.11 and 3.12 docstrings differ, so each has its own corpus). The
text goes through the same path a Megatron-LM run uses: a byte-level tokenizer writes an
`IndexedDataset` (`.bin`/`.idx`), and megatron-core's `BlendedMegatronDatasetBuilder` builds
`GPTDataset` train/valid/test splits over it, with Megatron's own document shuffling, sample index
(the compiled `helpers_cpp`) and index cache.

Typical use, on every rank after `torch.distributed` is initialised (or in a single process):

    prefix = prepare_indexed_dataset("/tmp/edit_data/stdlib_docs")
    train, valid, test = build_gpt_datasets(prefix, seq_length=128, num_samples=(6400, 64, 64),
                                            seed=1234)
    for batch in batch_iterator(train, micro_batch_size=4, start=dp_rank, stride=dp_size):
        ...
"""

import importlib
import inspect
import json
import os
import re
import secrets
import sys
import warnings
from collections import OrderedDict
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path
from ..mcore.compat import tokenizer_base

# Modules whose public names and docstrings are the same on every standard CPython build of one
# minor version (checked on 3.11 and 3.12).
# Left out on purpose: modules whose public names differ between platforms (os, subprocess,
# selectors, asyncio, multiprocessing, socket, webbrowser, getpass, ...) or with optional external
# libraries (hashlib, sqlite3, bz2, lzma, and ftplib, http.client, urllib.request and the other
# modules defining classes only when ssl imports), modules that warn on import as deprecated in
# 3.11 (imp, asynchat, telnetlib, ...), rlcompleter (importing it configures readline), and GUI
# modules (tkinter, turtle), which may be absent.
STDLIB_MODULES: Tuple[str, ...] = tuple(sorted("""
    abc argparse ast base64 bdb binascii bisect builtins cProfile calendar cmath cmd code
    codecs codeop collections collections.abc colorsys compileall configparser contextlib
    contextvars copy copyreg csv dataclasses datetime decimal difflib dis doctest email.charset
    email.generator email.header email.headerregistry email.message email.parser email.policy
    email.utils enum filecmp fileinput fnmatch fractions functools gettext glob graphlib gzip
    heapq hmac html html.parser http http.cookiejar http.cookies http.server importlib.metadata
    importlib.resources inspect ipaddress itertools json json.decoder json.encoder keyword
    linecache logging logging.config logging.handlers mailbox math mimetypes modulefinder netrc
    numbers operator optparse pathlib pdb pickle pickletools pkgutil plistlib pprint profile
    pstats py_compile pyclbr pydoc queue quopri random re reprlib runpy sched secrets shelve
    shlex socketserver stat statistics string struct symtable tabnanny tarfile tempfile
    textwrap threading timeit token tokenize tomllib trace traceback types typing unicodedata
    unittest unittest.case unittest.mock unittest.result unittest.suite urllib.error
    urllib.parse urllib.robotparser uuid warnings wave weakref wsgiref.handlers wsgiref.headers
    wsgiref.simple_server wsgiref.util xml.dom.minidom xml.etree.ElementTree xml.sax
    xml.sax.handler xml.sax.saxutils xmlrpc.client xmlrpc.server zipapp zipfile zipimport zlib
    zoneinfo
""".split()))

# Public names that debuggers and test runners replace at run time (pytest's debugging plugin
# swaps pdb.set_trace for its own): taking them would make the text depend on the process. On
# 3.11 pdb.set_trace has no docstring anyway; on 3.12 it has one.
_REPLACED_AT_RUN_TIME = frozenset({"pdb.set_trace"})

DOCUMENT_SEPARATOR = "\n\n\n"
"""Joins documents in `build_corpus`; never occurs inside a document (normalisation caps blank
lines at one)."""

EOD_ID = 256
"""End-of-document token, appended to every document in the indexed dataset."""

VOCAB_SIZE = 257
"""Byte values 0..255 plus `EOD_ID`. There is no pad id: megatron-core then pads with -1, which
cannot occur in the data, masks the loss there and maps it to token 0."""

_FORMAT_VERSION = 1  # bump when the corpus or the on-disk layout changes


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------


def _normalise(doc: str) -> str:
    """Dedent, expand tabs, drop trailing spaces and control characters, cap blank lines at one."""
    text = inspect.cleandoc(doc).expandtabs(4)
    text = re.sub(r"[^\S\n]*\n", "\n", text)  # trailing whitespace, \r
    text = re.sub(r"[\x00-\x08\x0b-\x1f\x7f]", " ", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _own_doc(obj: object) -> Optional[str]:
    """The docstring `obj` defines itself (a class's, not one inherited from a base)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) else None


def _is_documented_member(value: object) -> bool:
    # Plain attributes (ints, strings, ...) would contribute their type's docstring.
    return (
        inspect.isfunction(value)
        or isinstance(value, (classmethod, staticmethod, property))
        or inspect.ismethoddescriptor(value)
        or inspect.isdatadescriptor(value)
    )


def _module_documents(module_name: str) -> List[List[Tuple[str, str]]]:
    """Groups of (title, docstring) for one module: the module itself, then each public class
    (with its public methods) and each public function defined in it, sorted by name."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(module_name)
    groups = [[(module_name, _own_doc(module))]]
    for name, obj in sorted(vars(module).items()):
        title = f"{module_name}.{name}"
        if name.startswith("_") or title in _REPLACED_AT_RUN_TIME or getattr(obj, "__module__", None) != module_name:
            continue
        if inspect.isclass(obj):
            group = [(title, _own_doc(obj))]
            for member_name, member in sorted(vars(obj).items()):
                if not member_name.startswith("_") and _is_documented_member(member):
                    group.append((f"{title}.{member_name}", _own_doc(member)))
            groups.append(group)
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            groups.append([(title, _own_doc(obj))])
    return groups


def build_documents(max_bytes: int = 2_000_000) -> List[str]:
    """The corpus as a list of documents; see `build_corpus`."""
    documents, seen, size = [], set(), 0
    for module_name in STDLIB_MODULES:
        for group in _module_documents(module_name):
            parts = []
            for title, doc in group:
                if not doc:
                    continue
                text = _normalise(doc)
                # Generated docstrings (dataclasses) may embed reprs with memory addresses.
                if len(text) < 20 or text in seen or " at 0x" in text:
                    continue
                seen.add(text)
                parts.append(f"{title}\n\n{text}")
            if not parts:
                continue
            document = "\n\n".join(parts)
            cost = len(document.encode("utf-8")) + (len(DOCUMENT_SEPARATOR) if documents else 0)
            if size + cost > max_bytes:
                return documents
            documents.append(document)
            size += cost
    return documents


def build_corpus(max_bytes: int = 2_000_000) -> str:
    """Real English text, built without downloads and identical on every CPython of one version.

    The text is the docstrings of the standard-library modules in `STDLIB_MODULES`, visited in
    sorted order: each module's docstring, then, by name, every public class it defines (the
    class docstring followed by those of its public methods and properties) and every public
    function. Inherited docstrings, duplicates and docstrings containing memory addresses are
    skipped; whitespace is normalised. One module docstring, class or function is one document;
    documents are joined with `DOCUMENT_SEPARATOR`. Documents are taken in order while the UTF-8
    size stays within `max_bytes`, so a smaller budget gives a prefix of the larger corpus.
    """
    return DOCUMENT_SEPARATOR.join(build_documents(max_bytes))


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def encode(text: str) -> List[int]:
    """UTF-8 bytes of `text` as token ids (no EOD)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """Inverse of `encode`; EOD ids become `DOCUMENT_SEPARATOR`, broken UTF-8 becomes U+FFFD."""
    pieces, current = [], []
    for i in ids:
        i = int(i)
        if i == EOD_ID:
            pieces.append(bytes(current).decode("utf-8", errors="replace"))
            current = []
        else:
            current.append(i)
    pieces.append(bytes(current).decode("utf-8", errors="replace"))
    return DOCUMENT_SEPARATOR.join(pieces)


class ByteTokenizer(tokenizer_base()):
    """The byte tokenizer as the object `GPTDatasetConfig.tokenizer` expects.

    megatron-core's GPT dataset reads `vocab_size` (token dtype), `eod` (position ids and loss
    mask), `pad` if present (none here, see `VOCAB_SIZE`) and `unique_identifiers` (the hash
    naming the cached sample indices).
    """

    def __init__(self) -> None:
        super().__init__(path="", config={})

    def tokenize(self, text: str) -> List[int]:
        return encode(text)

    def detokenize(self, ids: Sequence[int]) -> str:
        return decode(ids)

    @property
    def vocab(self) -> Dict[str, int]:
        vocab = {bytes([i]).decode("latin-1"): i for i in range(256)}
        vocab["<eod>"] = EOD_ID
        return vocab

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE

    @property
    def eod(self) -> int:
        return EOD_ID

    @property
    def unique_identifiers(self) -> "OrderedDict[str, object]":
        return OrderedDict(
            [("class", f"{__name__}.{type(self).__qualname__}"), ("vocab_size", VOCAB_SIZE)]
        )

    def apply_chat_template(self, *args, **kwargs):
        raise NotImplementedError("ByteTokenizer has no chat template")

    def __repr__(self) -> str:  # appears in megatron-core's config log line
        return f"{type(self).__name__}(vocab_size={VOCAB_SIZE}, eod={EOD_ID})"


# --------------------------------------------------------------------------------------------
# Indexed dataset
# --------------------------------------------------------------------------------------------

_TOKEN_DTYPE = numpy.uint16  # what IndexedDataset's DType.optimal_dtype picks for VOCAB_SIZE


def _manifest_path(prefix: str) -> str:
    return prefix + ".json"


def _expected_manifest(max_bytes: int) -> Dict[str, object]:
    return {
        "format": _FORMAT_VERSION,
        "python": "%d.%d" % sys.version_info[:2],
        "max_bytes": max_bytes,
        "vocab_size": VOCAB_SIZE,
    }


def _is_complete(prefix: str, expected: Dict[str, object]) -> bool:
    try:
        with open(_manifest_path(prefix)) as f:
            manifest = json.load(f)
        bin_size = os.path.getsize(get_bin_path(prefix))
        idx_present = os.path.isfile(get_idx_path(prefix))
    except (OSError, ValueError):
        return False
    itemsize = numpy.dtype(_TOKEN_DTYPE).itemsize
    return (
        idx_present
        and all(manifest.get(k) == v for k, v in expected.items())
        and bin_size == manifest.get("num_tokens", -1) * itemsize
    )


def prepare_indexed_dataset(output_prefix: str, max_bytes: int = 2_000_000) -> str:
    """Write the tokenized corpus as `<output_prefix>.bin/.idx` and return `output_prefix`.

    One document per corpus document (`build_documents`), each followed by `EOD_ID`, stored as
    uint16. A `<output_prefix>.json` manifest, written last, marks the files complete and records
    what they were built from (format, Python version, `max_bytes`); a call finding a matching
    manifest and a `.bin` of the recorded size does nothing.

    Safe to call from every rank at once, no barrier needed: each writer fills its own temporary
    files and moves them into place with `os.replace`, and all writers produce identical bytes,
    so a reader sees either nothing, or complete files.
    """
    expected = _expected_manifest(max_bytes)
    if _is_complete(output_prefix, expected):
        return output_prefix

    directory = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(directory, exist_ok=True)
    tmp_prefix = f"{output_prefix}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp_paths = [get_bin_path(tmp_prefix), get_idx_path(tmp_prefix), _manifest_path(tmp_prefix)]
    try:
        documents = build_documents(max_bytes)
        builder = IndexedDatasetBuilder(get_bin_path(tmp_prefix), dtype=_TOKEN_DTYPE)
        num_tokens = 0
        for document in documents:
            ids = encode(document) + [EOD_ID]
            builder.add_item(torch.tensor(ids, dtype=torch.int32))
            builder.end_document()
            num_tokens += len(ids)
        builder.finalize(get_idx_path(tmp_prefix))
        manifest = dict(expected, num_documents=len(documents), num_tokens=num_tokens)
        with open(_manifest_path(tmp_prefix), "w") as f:
            json.dump(manifest, f, indent=2, sort_keys=True)
        os.replace(get_bin_path(tmp_prefix), get_bin_path(output_prefix))
        os.replace(get_idx_path(tmp_prefix), get_idx_path(output_prefix))
        os.replace(_manifest_path(tmp_prefix), _manifest_path(output_prefix))
    finally:
        for path in tmp_paths:
            if os.path.exists(path):
                os.remove(path)
    return output_prefix


# --------------------------------------------------------------------------------------------
# GPT datasets
# --------------------------------------------------------------------------------------------


def build_gpt_datasets(
    data_prefix: str,
    seq_length: int,
    num_samples: Tuple[int, int, int],
    seed: int,
    split: str = "949,50,1",
) -> Tuple[Optional[GPTDataset], Optional[GPTDataset], Optional[GPTDataset]]:
    """megatron-core `GPTDataset` train/valid/test splits over the indexed dataset at
    `data_prefix`, each with at least the requested number of samples (`num_samples`).

    `split` divides the documents, as Megatron-LM's `--split` does; each split cycles over its
    documents as many epochs as its sample count needs, shuffled with `seed`. A sample is a dict
    of int64 `tokens`, `labels` (tokens shifted by one), float `loss_mask` and int64
    `position_ids`, each of length `seq_length`; samples run across document boundaries (no
    reset of positions or attention, no attention mask: the model uses a causal mask).

    Every rank builds (`is_built_on_rank` is always true; the data is tiny). The sample indices
    are cached in `<dirname(data_prefix)>/cache`; with `torch.distributed` initialised,
    megatron-core builds them on rank 0 first and barriers, so call this on all ranks.
    """
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([data_prefix], None),
        split=split,
        path_to_cache=os.path.join(os.path.dirname(os.path.abspath(data_prefix)), "cache"),
        tokenizer=ByteTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    builder = BlendedMegatronDatasetBuilder(
        GPTDataset, list(num_samples), is_built_on_rank=lambda: True, config=config
    )
    train, valid, test = builder.build()
    return train, valid, test


def batch_sample_indices(batch: int, micro_batch_size: int, start: int, stride: int) -> List[int]:
    """Dataset indices of micro-batch number `batch` from `batch_iterator`:
    `start + (batch * micro_batch_size + j) * stride` for `j` in `range(micro_batch_size)`."""
    first = batch * micro_batch_size
    return [start + (first + j) * stride for j in range(micro_batch_size)]


def batch_iterator(
    dataset: torch.utils.data.Dataset, micro_batch_size: int, start: int = 0, stride: int = 1
) -> Iterator[Dict[str, torch.Tensor]]:
    """Yield micro-batches (dicts of tensors stacked along a new dim 0) of `dataset`.

    Every `stride`-th sample is read, beginning at `start` (see `batch_sample_indices`). With
    `start=r, stride=R`, data-parallel rank r of R reads samples r, r+R, r+2R, ...: at each step
    the R ranks together consume the next `R * micro_batch_size` samples of the one global order,
    which is fixed by the dataset's seed. To resume after `n` micro-batches per rank, pass
    `start = r + n * micro_batch_size * R`. Stops before the first micro-batch that would run
    past the end of the dataset.
    """
    if micro_batch_size < 1 or stride < 1 or start < 0:
        raise ValueError(f"bad micro_batch_size={micro_batch_size}, start={start}, stride={stride}")
    batch = 0
    while True:
        indices = batch_sample_indices(batch, micro_batch_size, start, stride)
        if indices[-1] >= len(dataset):
            return
        samples = [dataset[i] for i in indices]
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
        batch += 1
