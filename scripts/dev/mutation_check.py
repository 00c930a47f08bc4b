"""Mutation check of the quantized exchange's tests : apply one small defect
at a time to a copy of the package, run the exchange and codec tests against it, and count the
defects the tests catch ("killed"). The working tree is never modified.

    python scripts/dev/mutation_check.py            # prints a Markdown table, exits 1 if one survives
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/exchange", "tests/torchft_backend/test_fault_tolerant.py", "tests/algorithm/test_quantize.py"]

# (name, file, original text, mutated text)
MUTATIONS = [
    ("weighted sum divided by the workers again", "megatron_edit/exchange/outer_sync.py",
     "QuantizedReducer(self.quantized, sync.own_weights, mean=sync.weights is None)",
     "QuantizedReducer(self.quantized, sync.own_weights, mean=True)"),
    ("plain mean not divided", "megatron_edit/exchange/quantized.py",
     "        if mean:\n            own /= workers", "        if False:\n            own /= workers"),
    ("own weight not applied before quantizing", "megatron_edit/exchange/reducers.py",
     "    if own_weights is not None:\n        shard.scale_layers(delta, own_weights)",
     "    if False:\n        shard.scale_layers(delta, own_weights)"),
    ("scale off by one level", "megatron_edit/algorithm/quantize.py",
     "    scale = amax / _MAX[dtype]\n    safe", "    scale = amax / (_MAX[dtype] - 1)\n    safe"),
    ("decoded scale doubled", "megatron_edit/algorithm/quantize.py",
     "    return (values.view(-1, block) * scale).view(-1)[:numel]",
     "    return (values.view(-1, block) * scale * 2).view(-1)[:numel]"),
    ("int4 nibbles swapped", "megatron_edit/algorithm/quantize.py",
     "        values[0::2] = (body & 0x0F).to(torch.float32) - 8\n        values[1::2] = (body >> 4).to(torch.float32) - 8",
     "        values[1::2] = (body & 0x0F).to(torch.float32) - 8\n        values[0::2] = (body >> 4).to(torch.float32) - 8"),
    ("residual sign flipped", "megatron_edit/exchange/quantized.py",
     "            torch.sub(delta, sent, out=shard.residual)", "            torch.sub(sent, delta, out=shard.residual)"),
    ("residual not added", "megatron_edit/exchange/quantized.py",
     "            delta.add_(shard.residual)\n", "            pass\n"),
    ("chunk residual not added", "megatron_edit/exchange/quantized.py",
     "            own += shard.chunk_residual[: own.numel()]", "            pass"),
    ("skipped layers' residuals not kept", "megatron_edit/exchange/quantized.py",
     "        for s, e, values in saved:\n            residual[s:e].copy_(values)",
     "        for s, e, values in saved:\n            pass"),
    ("block as large as configured", "megatron_edit/exchange/quantized.py",
     "        block = max(1, min(self.block, per_worker))", "        block = self.block"),
    ("clip factor off by 1%", "megatron_edit/exchange/outer_sync.py",
     "        factors = penalty.clip_coefficients(norms, tau)", "        factors = penalty.clip_coefficients(norms, tau) * 1.01"),
    ("non-finite check off", "megatron_edit/exchange/outer_sync.py",
     "        if not bool(bad.any()):\n            return", "        if True:\n            return"),
]


def main() -> int:
    rows, survived = [], 0
    for name, rel, old, new in MUTATIONS:
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(ROOT / "megatron_edit", Path(tmp) / "megatron_edit")
            shutil.copytree(ROOT / "tests", Path(tmp) / "tests")
            shutil.copy(ROOT / "pytest.ini", tmp)
            path = Path(tmp) / rel
            text = path.read_text()
            assert text.count(old) == 1, f"mutation {name!r}: the original text is not there once"
            path.write_text(text.replace(old, new))
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *TESTS],
                                  cwd=tmp, env={**__import__("os").environ, "PYTHONPATH": tmp},
                                  capture_output=True, text=True)
            killed = proc.returncode != 0
            survived += not killed
            first = next((line for line in proc.stdout.splitlines() if line.startswith("FAILED")), "")
            rows.append((name, "killed" if killed else "SURVIVED", first.replace("FAILED ", "")[:90]))
    print("| mutation | result | first failing test |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\n{len(rows) - survived} of {len(rows)} mutations killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
