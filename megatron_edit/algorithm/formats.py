"""The exchange's formats, named once: the dense formats (:mod:`.quantize`), the top-k exchange's
value formats and its largest chunk (:mod:`.topk`). Plain values, importable without torch: the
configuration checks its flags with them before torch is imported."""

DENSE = ("fp32", "bf16", "fp8", "int8", "int4")
"""The dense exchange formats, most precise first (in order of size)."""

TOPK_VALUES = ("fp32", "int8", "int4", "int2")
"""The formats of the values the top-k exchange keeps."""

TOPK_MAX_CHUNK = 1 << 16
"""The largest top-k chunk: its indices take 16 bits."""
