#!/usr/bin/env python3
"""Which of Megatron-LM's shipped training recipes megatron_edit accepts with EDiT added.

For each recipe (a shell script under ``examples/`` or a functional test's
``model_config.yaml``), its Megatron flags are extracted the way the recipe itself would pass
them, ``--use-local-sgd --local-sgd-sync-interval 8`` is added, and the project's real launcher
(``megatron_edit.launch.main``: its early EDiT flag check, the CPU adapter, the runtime patches)
runs the recipe's training script (``pretrain_gpt.py`` / ``pretrain_hybrid.py``) on CPU until
Megatron's ``parse_and_validate_args`` has run ``validate_args`` -- which the project wraps with
``validate_local_sgd_args`` -- and stops there: nothing is built, no data is read, no process
group is created (``WORLD_SIZE`` is the recipe's GPU count, one process stands for rank 0).

Each recipe is checked in three variants, each repeated after every refusal with the refused flag
taken out (or, for what EDiT requires, the required flag put in), so that every flag that blocks
a recipe is found, not only the first:

* ``as_shipped``: the recipe + ``--use-local-sgd --local-sgd-sync-interval 8``.
* ``edit_setup``: also the Megatron flags the project's docs tell an EDiT user to add
  (``--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --num-distributed-optimizer-instances 2``, each only where the recipe lacks it).
* ``a_edit``: ``edit_setup`` + ``--local-sgd-async`` (A-EDiT).

Only the first call of the first recipe of a worker goes through the launcher's whole path; the
repeats (and, with ``--one-process``, the other recipes) re-run Megatron's ``parse_args`` (as
patched by the project) and the project-wrapped ``validate_args`` in the same process, as the
project's own probe test does (``tests/training/megatron_lm_probe.py``). A recipe whose own flags
stop the launcher's parse is checked behind a tiny stand-in recipe that the launcher runs instead.
Each refusal is classified: "setup" (a Megatron flag EDiT requires), "blocker" (a recipe flag the
project refuses), "gpu" / "env" (fails only for want of a GPU, transformer-engine or
nvidia-modelopt here: taken out, not judged), "upstream" (Megatron-LM itself refuses the recipe at
this tag: the smallest change, recorded), or "stuck" (anything else: the variant stops).

Usage (``nice -n 10`` on a shared machine)::

    python scripts/recipe_check.py collect --megatron-lm MLM [--set representative|census] > recipes.json
    python scripts/recipe_check.py check --megatron-lm MLM --project . --python VENV/bin/python \\
        [--set representative|census] [--one-process] [--sync-interval 8] [--only ID,ID] \\
        --out results.json
    python scripts/recipe_check.py table --results results.json [--no-rows]

``representative`` = the shell recipes under ``examples/`` + the functional tests listed in
``REPRESENTATIVE_TESTS`` (one process per recipe, about 10-40 s each); ``census`` = every GPT /
MoE / Mixtral / hybrid training functional test (use ``--one-process``: about 10 minutes).

``MLM`` is a Megatron-LM checkout (tag core_v0.19.0 for megatron-core 0.19.x), ``PROJECT`` the
megatron_edit checkout (put first on ``sys.path`` of the workers), ``--python`` the interpreter of
a venv with torch, the matching megatron-core, Megatron-LM's dependencies
(``scripts/requirements-megatron-lm.txt``) and megatron_edit. Scratch files go under
``--scratch`` (default ``/tmp/recipes-scratch``).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

DEFAULT_SCRATCH = "/tmp/recipes-scratch"
SETUP_FLAGS = [["--use-distributed-optimizer"], ["--overlap-grad-reduce"], ["--overlap-param-gather"],
               ["--num-distributed-optimizer-instances", "2"]]
VARIANTS = ("as_shipped", "edit_setup", "a_edit")

# --------------------------------------------------------------------------- the recipes

# Shell recipes under examples/ (bert, t5, multimodal, inference, post-training, RL skipped):
# (path, positional arguments, extra environment, working directory below the scratch folder).
EXAMPLE_SCRIPTS = [
    ("examples/gpt3/train_gpt3_175b_distributed.sh",
     ["{s}/ckpt", "{s}/tb", "{s}/data/gpt2-vocab.json", "{s}/data/gpt2-merges.txt", "{s}/data/text_document"], {}, "run"),
    ("examples/llama/train_llama3_8b_h100_fp8.sh", [], {}, "run"),
    ("examples/mixtral/train_mixtral_8x7b_distributed.sh",
     ["{s}/ckpt", "{s}/data/tokenizer.model", "{s}/data/text_document"], {}, "run"),
    ("examples/mamba/train.sh", ["{s}/data/text_document", "{s}/data/tokenizer.model"], {}, "run/examples/mamba"),
    ("examples/gptoss/02_train.sh", ["--checkpoint-path", "{s}/ckpt"], {}, "run"),
    ("examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh", [], {}, "run"),
    ("examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh", [],
     {"MEGATRON_PATH": "{s}/mlm", "OUTPUT_PATH": "{s}/out", "DATA_PATH": "{s}/data/text_document"}, "run"),
]



def _fix_gpt3_175b(argv: List[str]) -> List[str]:
    """The script passes ``${TRAINING_ARGS[@]}`` unquoted, so bash splits the quoted
    ``--step-batch-size-schedule "0:16 2.4B:320 ..."`` into words (Megatron's parser: "unrecognized
    arguments: 2.4B:320 ..."); and Megatron refuses the schedule together with
    ``--global-batch-size`` ("Cannot specify both"). As its author meant it: the schedule as one
    argument, no --global-batch-size."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--step-batch-size-schedule":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("--"):
                j += 1
            out += [argv[i], " ".join(argv[i + 1:j])]
            i = j
            continue
        out.append(argv[i])
        i += 1
    return drop_flag(out, "--global-batch-size")


def _fix_gptoss(argv: List[str]) -> List[str]:
    """The script sets the pipeline size to the GPU count (8, "adjust ... based on your setup"),
    which does not divide its 12 layers (Megatron: "Number of layers should be divisible by the
    pipeline-model-parallel size"), and leaves no data parallelism. As adjusted: PP 4 (2 replicas
    on the same 8 GPUs). It also passes ``--export-force-local-attention`` and
    ``--enable-gpt-oss``, which ``pretrain_gpt.py`` adds to the parser only when nvidia-modelopt is
    installed (``megatron/post_training/arguments.py``): without it here, they are left out (the
    launcher's own parse would stop at them before any check)."""
    argv = set_flag(argv, "--pipeline-model-parallel-size", "4")
    for flag in ("--export-force-local-attention", "--enable-gpt-oss"):
        argv = drop_flag(argv, flag)
    return argv


# Upstream recipes that Megatron-LM itself refuses as shipped at core_v0.19.0, each with the
# smallest change that makes Megatron accept it without EDiT (recorded in the results).
EXAMPLE_FIXUPS = {
    "examples/gpt3/train_gpt3_175b_distributed.sh": (
        _fix_gpt3_175b,
        "as shipped, Megatron's own parser refuses it (the unquoted array splits the quoted "
        "--step-batch-size-schedule: 'unrecognized arguments: 2.4B:320 ...'; and Megatron raises "
        "'Cannot specify both --step-batch-size-schedule and --global-batch-size'); checked with the "
        "schedule as one argument and without --global-batch-size"),
    "examples/gptoss/02_train.sh": (
        _fix_gptoss,
        "as shipped (PP = the 8 GPUs), Megatron refuses it: 'Number of layers should be divisible by the "
        "pipeline-model-parallel size' (12 layers); checked with PP 4 on the same 8 GPUs (DP 2), and without "
        "--export-force-local-attention / --enable-gpt-oss (nvidia-modelopt's flags: not installed here, "
        "not judged)"),
}

# Functional tests (tests/functional_tests/test_cases/<model>/<case>/model_config.yaml), a
# representative set: dense GPT, Llama-style, MoE with expert parallelism, FP8, context and
# virtual pipeline parallelism, the distributed optimizer, overlap flags, Megatron-FSDP, hybrid.
REPRESENTATIVE_TESTS = [
    "gpt/gpt3_mcore_tp1_pp2",
    "gpt/gpt3_mcore_tp2_pp2_uninstall_te",
    "gpt/gpt3_mcore_tp1_pp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt/gpt3_mcore_te_tp4_pp1_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt/gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist_dist_optimizer_overlap_grad_reduce_param_gather",
    "gpt/gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather_overlap_optimizer",
    "gpt/gpt3_mcore_te_tp1_pp4_vp1_resume_torch_dist_calculate_per_token_loss",
    "gpt/gpt3_mcore_te_tp2_pp2_cp2",
    "gpt/gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances",
    "gpt/gpt3_mcore_te_tp2_pp2_mla",
    "gpt/gpt3_weekly_mcore_tp2_pp2_current_scaling_native_fp8_tp_pp_sp_tp_overlap",
    "gpt/gpt3_weekly_mcore_tp4_cp2_current_scaling_native_fp8_tp_sp_cp_tp_overlap",
    "gpt/gpt3_7b_tp1_pp4_memory_speed",
    "gpt/gpt3_15b_8t_release",
    "gpt/gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor",
    "gpt/gpt3_mcore_reruns_persistent_1",
    "moe/gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel",
    "moe/gpt3_mcore_te_tp2_pp1_te_8experts2parallel_overlap_grad_reduce_param_gather_groupedGEMM",
    "moe/gpt3_mcore_te_tp2_pp1_te_a2a_ovlp_8experts_etp1_ep4",
    "moe/gpt3_mcore_tp2_cp2_pp2_ep2_te_4experts2parallel",
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer",
    "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_muon",
    "moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph",
    "mixtral/mixtral_8x7b_alltoall_tp2pp4ep4_release",
    "mixtral/deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release",
    "hybrid/hybrid_mr_mcore_te_tp1_pp2_vpp2_cp1_dgx_a100_1N8G",
]
CENSUS_MODELS = ("gpt", "moe", "mixtral", "hybrid")

FAKE_LAUNCHER = """#!/bin/bash
# recipe_check.py: stands in for a launcher; records its name and arguments (and, for sbatch,
# its standard input) as one JSON line, runs nothing.
exec {python} -c '
import json, os, sys
name = os.path.basename(sys.argv[1])
stdin = sys.stdin.read() if name == "sbatch" else ""
with open(os.environ["RECIPE_CAPTURE"], "a") as f:
    f.write(json.dumps({{"name": name, "argv": sys.argv[2:], "stdin": stdin,
                        "cdmc": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}}) + "\\n")
' "$0" "$@"
"""
FAKED = ("torchrun", "python", "python3", "uv", "sbatch", "srun", "nsys")
TORCHRUN_BOOL_OPTIONS = {"--standalone", "--no-python", "--no_python", "-m", "--module"}


def _flag_value(argv: List[str], flag: str, default=None):
    value = default
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = argv[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def _split_launcher(argv: List[str]) -> Tuple[Dict[str, str], Optional[str], List[str]]:
    """torchrun's options, the script and the script's arguments."""
    options, i = {}, 0
    while i < len(argv):
        a = argv[i]
        if a.endswith(".py") and not a.startswith("-"):
            return options, a, argv[i + 1:]
        if a.startswith("-"):
            if "=" in a:
                k, v = a.split("=", 1)
                options[k.lstrip("-").replace("-", "_")] = v
            elif a in TORCHRUN_BOOL_OPTIONS:
                options[a.lstrip("-")] = "1"
            else:
                options[a.lstrip("-").replace("-", "_")] = argv[i + 1] if i + 1 < len(argv) else ""
                i += 1
        i += 1
    return options, None, []


def _parse_capture(call: dict) -> Tuple[Optional[int], Optional[str], List[str]]:
    """(GPUs the recipe launches, script, script arguments) of one captured launcher call."""
    name, argv = call["name"], list(call["argv"])
    if name == "uv" and argv[:1] == ["run"]:
        return _parse_capture({"name": argv[1], "argv": argv[2:], "stdin": ""})
    if name == "nsys":  # nsys profile <options> <command...>
        for i, a in enumerate(argv):
            if a in FAKED:
                return _parse_capture({"name": a, "argv": argv[i + 1:], "stdin": ""})
        return None, None, []
    if name in ("python", "python3"):
        if argv[:2] == ["-m", "torch.distributed.run"]:
            argv = argv[2:]
        elif argv and argv[0].endswith(".py"):
            return None, argv[0], argv[1:]
        else:
            return None, None, []
    if name == "sbatch":  # the job's command line, inside the heredoc
        for line in call["stdin"].splitlines():
            m = re.search(r"\bpython\s+(\S+\.py)\s(.*)$", line)
            if m:
                rest = m.group(2).split('"', 1)[0]
                return None, m.group(1), shlex.split(rest)
        return None, None, []
    options, script, args = _split_launcher(argv)
    gpus = None
    if "nproc_per_node" in options:
        try:
            gpus = int(options["nproc_per_node"]) * int(options.get("nnodes", "1"))
        except ValueError:
            gpus = None
    return gpus, script, args


def collect_examples(mlm: str, scratch: str) -> List[dict]:
    fake_bin = os.path.join(scratch, "fake-bin")
    os.makedirs(fake_bin, exist_ok=True)
    for name in FAKED:
        path = os.path.join(fake_bin, name)
        with open(path, "w") as f:
            f.write(FAKE_LAUNCHER.format(python=shlex.quote(sys.executable)))
        os.chmod(path, 0o755)
    recipes = []
    for rel, positional, extra_env, cwd_rel in EXAMPLE_SCRIPTS:
        run_dir = os.path.join(scratch, "examples", os.path.basename(rel)[:-3], cwd_rel)
        os.makedirs(run_dir, exist_ok=True)
        for d in ("ckpt", "tb", "data", "out", "mlm"):
            os.makedirs(os.path.join(scratch, d), exist_ok=True)
        for stub in ("pretrain_gpt.py", os.path.join("mlm", "pretrain_gpt.py")):  # existence checks
            open(os.path.join(run_dir if stub == "pretrain_gpt.py" else scratch, stub), "a").close()
        capture = os.path.join(run_dir, "capture.jsonl")
        if os.path.exists(capture):
            os.remove(capture)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "WANDB"))}
        env.update({k: v.format(s=scratch) for k, v in extra_env.items()})
        env.update(PATH=fake_bin + os.pathsep + env.get("PATH", ""), RECIPE_CAPTURE=capture, USE_UV="1")
        proc = subprocess.run(["bash", os.path.join(mlm, rel), *[p.format(s=scratch) for p in positional]],
                              cwd=run_dir, env=env, capture_output=True, text=True, timeout=120)
        calls = [json.loads(line) for line in open(capture)] if os.path.exists(capture) else []
        parsed = [(*_parse_capture(c), c.get("cdmc")) for c in calls]
        parsed = [p for p in parsed if p[1]]
        if not parsed:
            recipes.append({"id": rel, "path": rel, "source": "example", "error":
                            f"no launcher call captured (exit {proc.returncode}): {proc.stderr[-300:]}"})
            continue
        gpus, script, args, cdmc = parsed[-1]
        recipe = {"id": rel, "path": rel, "source": "example", "script": os.path.basename(script),
                  "argv": args, "recipe_gpus": gpus,
                  "env": {"CUDA_DEVICE_MAX_CONNECTIONS": cdmc} if cdmc else {}}
        if rel in EXAMPLE_FIXUPS:
            fix, note = EXAMPLE_FIXUPS[rel]
            recipe.update(shipped_argv=args, argv=fix(args), fixup=note)
        recipes.append(recipe)
    return recipes


NUMERIC_VARS = {"REPEAT": "1"}  # the harness's repeat number (used as a --seed)


def _yaml_args(model_args: dict, scratch: str) -> List[str]:
    """MODEL_ARGS as tests/functional_tests/shell_test_utils/_run_training.sh passes them:
    true -> the flag alone; "( ... )" and values with spaces -> one argument; "[a b]" -> a, b;
    ${VAR} / $VAR -> expanded (here: a scratch path named after the variable)."""
    def expand(text: str) -> str:
        return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?",
                      lambda m: NUMERIC_VARS.get(m.group(1), f"{scratch}/{m.group(1).lower()}"), text)

    if "<<" in model_args:  # a YAML merge key (yq's explode(.) in the harness): the base, then the rest
        merged = dict(model_args["<<"])
        merged.update({k: v for k, v in model_args.items() if k != "<<"})
        model_args = merged
    out: List[str] = []
    for key, value in model_args.items():
        value = "" if value is None else str(value).strip()
        if value in ("true", "True"):
            out.append(key)
        elif re.fullmatch(r"\([^)]+\)", value):
            out += [key, value]
        elif re.fullmatch(r"\[[^\]]+\]", value):
            out += [key, *shlex.split(expand(value[1:-1]))]
        elif any(c in value for c in " |()"):
            out += [key, expand(value)]
        elif value == "":
            out.append(key)
        else:
            out += [key, *shlex.split(expand(value))]
    return out


def collect_tests(mlm: str, scratch: str, which: str) -> List[dict]:
    import yaml

    root = os.path.join(mlm, "tests", "functional_tests", "test_cases")
    if which == "representative":
        cases = REPRESENTATIVE_TESTS
    else:
        cases = []
        for model in CENSUS_MODELS:
            for case in sorted(os.listdir(os.path.join(root, model))):
                if "inference" in case or "grpo" in case or "flextron" in case:
                    continue  # other scripts (inference, train_rl.py, elastification/pretrain_hybrid_flex.py)
                if os.path.exists(os.path.join(root, model, case, "model_config.yaml")):
                    cases.append(f"{model}/{case}")
    recipes = []
    for case in cases:
        rel = f"tests/functional_tests/test_cases/{case}/model_config.yaml"
        with open(os.path.join(mlm, rel)) as f:
            config = yaml.load(f, Loader=yaml.BaseLoader)  # every scalar as the text yq reads
        model_args = config.get("MODEL_ARGS")
        if not isinstance(model_args, dict):
            continue
        script = "pretrain_hybrid.py" if case.startswith("hybrid/") else "pretrain_gpt.py"
        env = {k: str(v) for k, v in (config.get("ENV_VARS") or {}).items() if k == "CUDA_DEVICE_MAX_CONNECTIONS"}
        # GPUs: the harness's 8 per node (tests/test_utils/recipes/*.yaml: 1 node) unless the
        # test's MODEL_ENV_VARS say otherwise for its first run.
        gpus = ((config.get("MODEL_ENV_VARS") or {}).get("MODEL_ARGS") or {}).get("GPUS_PER_NODE", "8")
        recipes.append({"id": case, "path": rel, "source": "functional_test", "script": script,
                        "argv": _yaml_args(model_args, scratch), "recipe_gpus": int(gpus),
                        "test_type": config.get("TEST_TYPE"), "env": env})
    return recipes


# --------------------------------------------------------------------------- argv editing

def _int(argv, flag, default):
    v = _flag_value(argv, flag)
    try:
        return int(v) if v is not None else default
    except ValueError:
        return default


def parallelism(argv: List[str]) -> Dict[str, int]:
    tp = _int(argv, "--tensor-model-parallel-size", 1)
    p = {"tp": tp, "pp": _int(argv, "--pipeline-model-parallel-size", 1),
         "cp": _int(argv, "--context-parallel-size", 1),
         "ep": _int(argv, "--expert-model-parallel-size", 1),
         "etp": _int(argv, "--expert-tensor-parallel-size", tp),
         "vp": _int(argv, "--num-layers-per-virtual-pipeline-stage", 0) or _int(argv, "--num-virtual-stages-per-pipeline-rank", 0)}
    return p


def world_size(argv: List[str], recipe_gpus: Optional[int]) -> int:
    """The recipe's GPU count, or the least larger one that Megatron's grid accepts with more
    than one data-parallel replica (EDiT needs two workers)."""
    p = parallelism(argv)
    model = p["tp"] * p["pp"] * p["cp"]
    expert = p["etp"] * p["ep"] * p["pp"]
    w = max(recipe_gpus or model, 1)
    while w % model or w % expert or w // model < 2:
        w += 1
    return w


def cuda_device_max_connections(argv: List[str], recipe_env: Dict[str, str]) -> str:
    """The recipe's own value (its ENV_VARS, or what its script exports), else the launcher's CPU
    default (its prepare_environment: 8 with --use-megatron-fsdp, else 1). Torch-FSDP2 without a
    value: 8, since on a GPU the variable would stay unset and only the CPU launcher's default of
    1 trips Megatron's "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one"."""
    fsdp = "--use-megatron-fsdp" in argv or "--use-torch-fsdp2" in argv
    value = recipe_env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    # The recipe's value while it fits (more than one is for FSDP: with FSDP taken out, as the
    # launcher would set it; the CPU adapter reports a pre-Blackwell device, where Megatron
    # requires 1 with TP or CP > 1).
    if value and (int(value) > 1) == fsdp:
        return value
    return "8" if fsdp else "1"


def drop_flag(argv: List[str], flag: str) -> List[str]:
    """argv without ``flag`` (and ``--flag=value``) and the values that follow it."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == flag:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                i += 1
            continue
        if a.startswith(flag + "="):
            i += 1
            continue
        out.append(a)
        i += 1
    return out


def has_flag(argv: List[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def set_flag(argv: List[str], flag: str, *values: str) -> List[str]:
    return drop_flag(argv, flag) + [flag, *values]


def variant_argv(recipe_argv: List[str], variant: str, sync_interval: int = 8) -> List[str]:
    argv = [("gloo" if i > 0 and recipe_argv[i - 1] == "--distributed-backend" else a)
            for i, a in enumerate(recipe_argv)]
    argv = [a for a in argv if not a.startswith("--distributed-backend=")]
    if not has_flag(argv, "--distributed-backend"):
        argv += ["--distributed-backend", "gloo"]  # the launcher on CPU requires gloo
    argv += ["--use-local-sgd", "--local-sgd-sync-interval", str(sync_interval)]
    if variant in ("edit_setup", "a_edit"):
        for flags in SETUP_FLAGS:
            if not has_flag(argv, flags[0]):
                argv += flags
    if variant == "a_edit":
        argv += ["--local-sgd-async"]
    return argv


def samples_to_iters(argv: List[str]) -> List[str]:
    """--train-samples and the sample-based schedule as iterations (A-EDiT needs --train-iters)."""
    gbs = _int(argv, "--global-batch-size", 0) or 1
    for samples, iters in (("--train-samples", "--train-iters"), ("--lr-decay-samples", "--lr-decay-iters"),
                           ("--lr-warmup-samples", "--lr-warmup-iters"),
                           ("--lr-wsd-decay-samples", "--lr-wsd-decay-iters")):
        v = _flag_value(argv, samples)
        if v is not None:
            argv = set_flag(argv, iters, str(max(1, math.ceil(float(v) / gbs))))
            argv = drop_flag(argv, samples)
    return argv


# --------------------------------------------------------------------------- refusals

# (pattern on the message, kind, the flag it is counted under, how to go on).
# kind: "setup" = a Megatron flag EDiT requires and the recipe lacks (the docs say to add it);
# "blocker" = a flag of the recipe the project refuses; "gpu" = refused only because there is no
# GPU here (not judged). Actions: ("add", flags) / ("drop", flags) / ("replace", drop, add) /
# ("samples_to_iters",).
RULES = [
    (r"needs Megatron's distributed optimizer", "setup", "(no --use-distributed-optimizer)",
     ("add", ["--use-distributed-optimizer"])),
    (r"--local-sgd-sync-mode layerwise syncs each bucket", "setup", "(no --overlap-param-gather)",
     ("add", ["--overlap-param-gather", "--overlap-grad-reduce"])),
    (r"--num-distributed-optimizer-instances=\d+ \(the number of EDiT workers\) must divide", "setup",
     "--num-distributed-optimizer-instances", ("replace", ["--num-distributed-optimizer-instances"],
                                               ["--num-distributed-optimizer-instances", "1"])),
    (r"^fp16 with loss scaling", "blocker", "--fp16 (loss scaling)",
     ("replace", ["--fp16", "--loss-scale"], ["--bf16"])),
    (r"--moe-grouped-gemm needs CUDA", "gpu", "--moe-grouped-gemm", ("drop", ["--moe-grouped-gemm"])),
    (r"--moe-token-dispatcher-type flex needs CUDA", "gpu", "--moe-token-dispatcher-type flex",
     ("replace", ["--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend", "--moe-enable-deepep"],
      ["--moe-token-dispatcher-type", "alltoall"])),
    (r"CUDA graphs \(--cuda-graph-impl", "blocker", "--cuda-graph-impl / --enable-cuda-graph",
     ("drop", ["--cuda-graph-impl", "--enable-cuda-graph", "--external-cuda-graph", "--cuda-graph-scope",
               "--cuda-graph-modules"])),
    (r"--optimizer \S+ with --use-local-sgd", "blocker", "--optimizer (not adam/sgd)",
     ("drop", ["--optimizer", "--use-layer-wise-distributed-optimizer"])),
    (r"^--local-sgd-async needs --train-iters", "blocker", "--train-samples (A-EDiT needs --train-iters)",
     ("samples_to_iters",)),
    (r"--moe-router-load-balancing-type global_aux_loss", "blocker",
     "--moe-router-load-balancing-type global_aux_loss", ("drop", ["--moe-router-load-balancing-type"])),
    (r"^--expert-tensor-parallel-size \d+ different from", "blocker",
     "--expert-tensor-parallel-size != TP (MoE)", ("drop", ["--expert-tensor-parallel-size"])),
    (r"^--rerun-mode report_stats", "blocker", "--rerun-mode report_stats", ("drop", ["--rerun-mode"])),
    (r"^--ckpt-format torch with", "blocker", "--ckpt-format torch", ("drop", ["--ckpt-format"])),
    (r"^--fsdp-double-buffer / --nccl-ub with EDiT on Megatron-FSDP", "blocker",
     "--fsdp-double-buffer / --use-nccl-ub (Megatron-FSDP)",
     ("drop", ["--fsdp-double-buffer", "--use-nccl-ub", "--fsdp-manual-registration"])),
    (r"^(--tensor-model-parallel-size|--pipeline-model-parallel-size|--context-parallel-size) > 1 with EDiT on "
     r"Megatron-FSDP", "blocker", "TP/PP/CP > 1 with Megatron-FSDP",
     ("drop", ["--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
               "--sequence-parallel"])),
    (r"^--data-parallel-sharding-strategy \S+ with EDiT on Megatron-FSDP", "blocker",
     "--data-parallel-sharding-strategy != optim_grads_params (Megatron-FSDP)",
     ("drop", ["--data-parallel-sharding-strategy"])),
    (r"^--megatron-fsdp-main-params-dtype", "blocker", "--megatron-fsdp-main-params-dtype != fp32",
     ("drop", ["--megatron-fsdp-main-params-dtype"])),
]
FLAG_RE = re.compile(r"--[a-z0-9][a-z0-9-]*")
GPU_HINTS = re.compile(r"transformer.?engine|\bTE\b|CUDA|cuda|apex|flash.?attn|GPU|nvidia|fp8", re.I)


def _rule_for(message: str, argv: List[str]):
    for pattern, kind, label, action in RULES:
        if re.search(pattern, message):
            return kind, label, action
    # The message names the flag first: take the first flag it names that the run passes.
    for flag in FLAG_RE.findall(message):
        if flag.startswith("--use-local-sgd") or flag.startswith("--local-sgd") or flag.startswith("--outer-"):
            continue
        if has_flag(argv, flag):
            return "blocker", flag, ("drop", [flag])
    return None


def _apply(action, argv: List[str]) -> List[str]:
    if action[0] == "add":
        return argv + [f for f in action[1] if not has_flag(argv, f)]
    if action[0] == "drop":
        for f in action[1]:
            argv = drop_flag(argv, f)
        return argv
    if action[0] == "replace":
        for f in action[1]:
            argv = drop_flag(argv, f)
        return argv + action[2]
    if action[0] == "samples_to_iters":
        return samples_to_iters(argv)
    raise ValueError(action)


# --------------------------------------------------------------------------- the worker

class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: List[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class _SpecCheck:
    """Every spec's check, in process, from the hook that replaces Megatron's validate_args:
    ``arguments`` (megatron.training.arguments), ``project_validate`` (the project's wrapper
    around Megatron's validate_args), ``defaults`` (what the launcher's validate_args call
    passed), ``script`` (the first spec's, as sys.argv[0])."""

    def __init__(self, script: str, warnings_handler: _Warnings, arguments, project_validate, defaults):
        self.script, self.warnings_handler = script, warnings_handler
        self.arguments, self.project_validate, self.defaults = arguments, project_validate, defaults

    def validate_once(self, argv, recipe_gpus, parsed=None, env=None):
        """(outcome, message, derived) of one parse + validate."""
        from megatron_edit import launch
        from megatron_edit.config import ConfigError

        os.environ["WORLD_SIZE"] = str(world_size(argv, recipe_gpus))
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = cuda_device_max_connections(argv, env or {})
        self.warnings_handler.lines.clear()
        held = io.StringIO()
        try:
            with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
                if parsed is None:
                    sys.argv = [self.script, *argv]
                    args = self.arguments.parse_args(None, False)  # the project's wrapper: adds the EDiT flags
                else:
                    args = parsed
                self.project_validate(args, self.defaults)
        except ConfigError as e:  # the project's refusal (NotSupportedYet is a ConfigError)
            return "refused", launch._in_megatron_lm_terms(str(e)), {}
        except SystemExit as e:  # argparse
            tail = held.getvalue().strip().splitlines()[-1:] or [str(e)]
            return "megatron_error", f"argparse: {tail[0]}", {}
        except Exception as e:  # Megatron's own validation
            import traceback

            where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}"
                     for f in traceback.extract_tb(e.__traceback__)[-4:]]
            return "megatron_error", f"{type(e).__name__}: {e}", {"where": where}
        derived = {k: getattr(args, k, None) for k in (
            "world_size", "data_parallel_size", "num_distributed_optimizer_instances",
            "use_distributed_optimizer", "overlap_param_gather", "overlap_grad_reduce", "train_iters",
            "local_sgd_sync_mode")}
        derived["warnings"] = list(self.warnings_handler.lines)
        return "accepted", "", derived

    def check_spec(self, spec, first_parsed=None) -> dict:
        """One spec's record: the shipped script's first word, then every variant."""
        record = {k: spec.get(k) for k in ("id", "path", "source", "script", "recipe_gpus", "test_type", "fixup",
                                           "sync_interval")}
        record["recipe_argv"] = spec["argv"]
        record["parallelism"] = parallelism(spec["argv"])
        record["variants"] = {}
        if spec.get("shipped_argv"):  # the upstream script unchanged: what Megatron says first
            outcome, message, _ = self.validate_once(variant_argv(spec["shipped_argv"], VARIANTS[0],
                                                                  spec.get("sync_interval", 8)),
                                                     spec.get("recipe_gpus"), env=spec.get("env"))
            record["shipped_unfixed"] = {"outcome": outcome, "message": message}
        for variant in VARIANTS:
            record["variants"][variant] = self.check_variant(spec, variant,
                                                             first_parsed if variant == VARIANTS[0] else None)
        return record

    def check_variant(self, spec, variant, first_parsed=None) -> dict:
        """One variant of a spec: validated, and after each refusal the rule's change applied
        and validated again (at most 20 attempts) until accepted or stuck."""
        argv = variant_argv(spec["argv"], variant, spec.get("sync_interval", 8))
        steps = []
        for attempt in range(20):
            parsed = first_parsed if attempt == 0 else None
            outcome, message, derived = self.validate_once(argv, spec.get("recipe_gpus"), parsed, spec.get("env"))
            step = {"outcome": outcome, "message": message, "world_size": int(os.environ["WORLD_SIZE"])}
            if derived.get("where"):
                step["where"] = derived["where"]
            if outcome == "accepted":
                step["derived"] = derived
                steps.append(step)
                break
            rule = _rule_for(message, argv) if outcome == "refused" else None
            if outcome == "megatron_error":
                rule = _megatron_rule(message, argv)
            if rule is None:
                step["kind"] = "stuck"
                steps.append(step)
                break
            kind, label, action = rule
            step.update(kind=kind, flag=label, action=list(action[:1]))
            steps.append(step)
            new_argv = _apply(action, argv)
            if new_argv == argv:
                step["kind"] = "stuck"
                break
            argv = new_argv
        return {"steps": steps, "final_argv": argv}


def _hook_validation(api, specs, warnings_handler: _Warnings, out_path: str, results: List[dict]) -> None:
    """Once the launcher has patched Megatron for EDiT (api.patch_megatron_for_local_sgd), its
    validate_args is replaced by the check of every spec (:class:`_SpecCheck`; the first with
    what the launcher parsed), which writes ``out_path`` and ends the process."""
    original_patch = api.patch_megatron_for_local_sgd

    def patch_and_hook(*a, **k):
        out = original_patch(*a, **k)
        import megatron.training.arguments as arguments

        project_validate = arguments.validate_args  # the project's wrapper around Megatron's

        def stop_after_validation(args, defaults={}, *rest, **kw):  # noqa: B006 - Megatron's signature
            check = _SpecCheck(specs[0]["script"], warnings_handler, arguments, project_validate, defaults)
            try:
                for i, spec in enumerate(specs):
                    t0 = time.time()
                    rec = check.check_spec(spec, args if i == 0 else None)
                    rec["seconds"] = round(time.time() - t0, 2)
                    rec["through_launcher"] = i == 0
                    results.append(rec)
            finally:
                with open(out_path, "w") as f:
                    json.dump({"results": results, "launcher_reached_validation": True}, f, indent=1)
            sys.stdout.flush()
            os._exit(0)  # nothing else to do: stop before Megatron sets up anything

        arguments.validate_args = stop_after_validation
        return out

    api.patch_megatron_for_local_sgd = patch_and_hook


def _worker(mlm: str, specs_path: str, out_path: str) -> None:
    """One process: the launcher runs the first spec's script; the hook after the project's
    validate_args checks every spec (all variants, repeated after each refusal) in process."""
    specs = json.load(open(specs_path))
    first = specs[0]
    os.environ["RECIPE_MLM"] = mlm
    MODELOPT_FLAGS.update(_modelopt_flags())
    first_argv = variant_argv(first["argv"], VARIANTS[0], first.get("sync_interval", 8))
    os.environ.update(RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      WORLD_SIZE=str(world_size(first_argv, first.get("recipe_gpus"))),
                      CUDA_DEVICE_MAX_CONNECTIONS=cuda_device_max_connections(first_argv, first.get("env") or {}))
    from megatron_edit import api, launch

    warnings_handler = _Warnings()
    logging.getLogger("megatron_edit").addHandler(warnings_handler)
    results: List[dict] = []
    _hook_validation(api, specs, warnings_handler, out_path, results)
    script = os.path.join(mlm, first["script"])
    launcher_argv = ["--cpu", script, *first_argv]
    sys.argv = ["megatron_edit.launch", *launcher_argv]
    launch.main(launcher_argv)
    # Only reached when the launcher stopped before validate_args (its own exits end the process).
    with open(out_path, "w") as f:
        json.dump({"results": results, "launcher_reached_validation": False}, f)


def _megatron_rule(message: str, argv: List[str]):
    """Megatron's own validation error. What fails only for want of a GPU (or of an optional
    package a GPU cluster has) is taken out and the check goes on ("gpu" / "env": not judged);
    a recipe Megatron-LM itself refuses at this tag is changed as little as possible and the
    check goes on ("upstream"); anything else stops the variant."""
    if "no NVIDIA driver" in message or "CUDA driver" in message:
        for flag in ("--moe-grouped-gemm",):  # validate_args asks the device's compute capability
            if has_flag(argv, flag):
                return "gpu", flag, ("drop", [flag])
        return None
    if "--use-torch-fsdp2 is not supported with MCore's distributed optimizer" in message:
        # EDiT needs the distributed optimizer, which Megatron refuses with Torch-FSDP2 (the
        # project's own refusal of --use-torch-fsdp2 runs after its distributed-optimizer check).
        return "blocker", "--use-torch-fsdp2", ("drop", ["--use-torch-fsdp2"])
    if re.search(r"only supported with TE >= [\d.]+ when enabling delay_wgrad_compute", message):
        return "gpu", "--delay-wgrad-compute (needs transformer-engine)", ("drop", ["--delay-wgrad-compute"])
    m = re.match(r"argparse: .*argument (--[a-z0-9-]+): invalid int value: '(\d+(?: \d+)+)'", message)
    if m and has_flag(argv, m.group(1)):  # "2 2" passed as one argument (the harness's quoting)
        flag, words = m.group(1), m.group(2).split()
        return "upstream", f"{flag} (one argument '{m.group(2)}')", ("replace", [flag], [flag, *words])
    if message.startswith("AssertionError: --deterministic-mode requires:"):
        return "upstream", "--deterministic-mode (Megatron: incompatible options)", ("drop", ["--deterministic-mode"])
    m = re.match(r"argparse: .*unrecognized arguments: (.*)$", message)
    if m:
        unknown = [a for a in m.group(1).split() if a.startswith("--")]
        present = [a for a in unknown if has_flag(argv, a)]
        if present:
            modelopt = all(a in MODELOPT_FLAGS for a in present)
            return ("env" if modelopt else "upstream"), " ".join(present) + (
                " (nvidia-modelopt's flags)" if modelopt else " (unknown to Megatron)"), ("drop", present)
    return None


def _modelopt_flags() -> set:
    """The flags megatron/post_training/arguments.py adds (pretrain_gpt.py passes them to the parser
    only when nvidia-modelopt is installed)."""
    flags = set()
    path = os.path.join(os.environ.get("RECIPE_MLM", ""), "megatron", "post_training", "arguments.py")
    if os.path.exists(path):
        flags = set(re.findall(r"[\'\"](--[a-z0-9-]+)[\'\"]", open(path).read()))
    return flags


MODELOPT_FLAGS: set = set()


# --------------------------------------------------------------------------- driver

BOOTSTRAP_ID = "__launcher_stand_in__"


def bootstrap_spec(script: str) -> dict:
    """A tiny recipe the launcher runs when a recipe's own flags stop its parse (not reported)."""
    argv = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
            "--max-position-embeddings 128 --micro-batch-size 1 --global-batch-size 8 --train-iters 16 "
            "--lr 1e-4 --bf16 --mock-data --tokenizer-type NullTokenizer --vocab-size 1024").split()
    return {"id": BOOTSTRAP_ID, "path": "", "source": "stand-in", "script": script, "argv": argv,
            "recipe_gpus": 8, "env": {}}


def _run_workers(args, recipes: List[dict]) -> List[dict]:
    results = []
    groups = []
    if args.one_process:
        by_script: Dict[str, List[dict]] = {}
        for r in recipes:
            by_script.setdefault(r["script"], []).append(r)
        groups = list(by_script.values())
    else:
        groups = [[r] for r in recipes]
    env = dict(os.environ)
    env["PYTHONPATH"] = args.project + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONWARNINGS"] = "ignore"
    launcher_stopped: Dict[str, List[str]] = {}
    while groups:
        group = groups.pop(0)
        with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
            spec_path, out_path = os.path.join(tmp, "specs.json"), os.path.join(tmp, "out.json")
            json.dump(group, open(spec_path, "w"))
            t0 = time.time()
            proc = subprocess.run([args.python, os.path.abspath(__file__), "_worker", "--megatron-lm", args.megatron_lm,
                                   "--specs", spec_path, "--out", out_path],
                                  cwd=tmp, env=env, capture_output=True, text=True, timeout=args.timeout)
            wall = round(time.time() - t0, 1)
            if os.path.exists(out_path):
                got = json.load(open(out_path))["results"]
            else:
                got = []
            done = {r["id"] for r in got}
            for r in got:
                r["worker_wall_s"] = wall
            got = [r for r in got if r["id"] != BOOTSTRAP_ID]
            if not got and group[0]["id"] != BOOTSTRAP_ID and len(group) > 1:
                groups.insert(0, group[1:])  # the first recipe stopped the launcher: the rest again
                group = group[:1]
            if not got and group[0]["id"] != BOOTSTRAP_ID:
                # The launcher's own parse stopped at this recipe's flags before any check: check it
                # in process behind a stand-in recipe that the launcher runs instead.
                groups.insert(0, [bootstrap_spec(group[0]["script"]), group[0]])
                launcher_stopped[group[0]["id"]] = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                continue
            for spec in group:
                if spec["id"] not in done and spec["id"] != BOOTSTRAP_ID:
                    got.append({"id": spec["id"], "path": spec["path"], "source": spec["source"],
                                "worker_error": f"exit {proc.returncode}: " + (proc.stderr or proc.stdout)[-1500:]})
            for r in got:
                if r["id"] in launcher_stopped:
                    r["through_launcher"] = False
                    r["launcher_stopped_at"] = launcher_stopped[r["id"]]
            results += got
            print(f"[{len(results)}/{len(recipes)}] {', '.join(s['id'] for s in group)[:100]} ({wall} s)",
                  file=sys.stderr, flush=True)
    return results


def summarize(record: dict) -> dict:
    """The verdict of one recipe from its variants' steps."""
    if "worker_error" in record:
        return {"verdict": "error", "detail": record["worker_error"][-200:]}
    out = {}
    for variant, v in record["variants"].items():
        steps = v["steps"]
        of = lambda kind: [(s["flag"], s["message"]) for s in steps if s.get("kind") == kind]  # noqa: E731
        last = steps[-1]
        derived = last.get("derived", {})
        blockers, setup = of("blocker"), [f for f, _ in of("setup")]
        not_judged = of("gpu") + of("env")
        stuck = [(s["outcome"], s["message"]) for s in steps if s.get("kind") == "stuck"]
        if stuck:
            verdict = "not judged (Megatron refuses it)" if not blockers else "refused"
        elif blockers:
            verdict = "refused"
        else:
            verdict = "accepted"
        out[variant] = {
            "verdict": verdict, "blockers": blockers, "setup": setup, "not_judged": not_judged,
            "upstream": of("upstream"), "stuck": stuck, "ends_accepted": last["outcome"] == "accepted",
            "warnings": derived.get("warnings", []), "dp": derived.get("data_parallel_size"),
            "workers": derived.get("num_distributed_optimizer_instances"), "world": last.get("world_size"),
        }
    return out


def _as_shipped_cell(v: dict) -> str:
    if v["verdict"] != "accepted":
        flags = ", ".join(dict.fromkeys(f for f, _ in v["blockers"]))
        return f"refused: {flags}" if flags else v["verdict"]
    if v["setup"]:
        return "needs " + " + ".join(f.strip("()").replace("no ", "") for f in v["setup"])
    if v["workers"] == 1:
        return "accepted, but 1 worker (warned)"
    return "accepted"


def _kind(record: dict) -> str:
    argv = record.get("recipe_argv", [])
    p = record.get("parallelism", {})
    parts = []
    if record.get("script") == "pretrain_hybrid.py":
        parts.append("hybrid (Mamba)")
    elif has_flag(argv, "--num-experts"):
        parts.append(f"MoE {_flag_value(argv, '--num-experts')} experts")
    else:
        parts.append("dense GPT" if not has_flag(argv, "--swiglu") else "dense Llama-style")
    if has_flag(argv, "--multi-latent-attention"):
        parts.append("MLA")
    if has_flag(argv, "--fp8-format") or has_flag(argv, "--fp8-recipe"):
        parts.append("FP8")
    if has_flag(argv, "--fp16"):
        parts.append("fp16")
    return ", ".join(parts)


def _par(record: dict, world=None) -> str:
    p = record.get("parallelism", {})
    s = f"TP{p.get('tp', 1)} PP{p.get('pp', 1)}"
    if p.get("vp"):
        s += " VP"
    if p.get("cp", 1) > 1:
        s += f" CP{p['cp']}"
    if p.get("ep", 1) > 1:
        s += f" EP{p['ep']}"
        if p.get("etp") != p.get("tp"):
            s += f" ETP{p['etp']}"
    argv = record.get("recipe_argv", [])
    if has_flag(argv, "--use-megatron-fsdp"):
        s += " M-FSDP"
    if has_flag(argv, "--use-distributed-optimizer"):
        s += " distopt"
    if world:
        s += f"; {world} GPUs"
    return s


def table(results: List[dict]) -> str:
    lines = ["| recipe | kind | parallelism (GPUs checked) | as shipped + `--use-local-sgd --local-sgd-sync-interval 8` "
             "| + EDiT's set-up flags | refusing flag(s) | first refusal (first 100 characters) | A-EDiT adds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        s = summarize(r)
        if "verdict" in s:
            lines.append(f"| `{r['path']}` | | | error | | | {s['detail'][:100]!r} | |")
            continue
        a, b, c = s["as_shipped"], s["edit_setup"], s["a_edit"]
        vb = b["verdict"]
        if b["not_judged"]:
            vb += " (not judged: " + ", ".join(dict.fromkeys(f for f, _ in b["not_judged"])) + ")"
        flags = ", ".join(dict.fromkeys(f for f, _ in b["blockers"])) or "—"
        first = b["blockers"][0][1] if b["blockers"] else (b["stuck"][0][1] if b["stuck"] else "")
        extra = [f for f, _ in c["blockers"] if f not in [x for x, _ in b["blockers"]]]
        vc = ", ".join(dict.fromkeys(extra)) if extra else ("nothing more" if c["verdict"] == b["verdict"] else c["verdict"])
        note = " (fixed up, see notes)" if r.get("fixup") or b["upstream"] else ""
        lines.append(f"| `{r['path']}`{note} | {_kind(r)} | {_par(r, b['world'])} | {_as_shipped_cell(a)} | {vb} | "
                     f"{flags} | {first[:100].replace('|', '/')} | {vc} |")
    return "\n".join(lines)


def ranking(results: List[dict], variant: str = "edit_setup", baseline: Optional[str] = None) -> str:
    """Refusing flags by how many recipes each blocks (any position, not only the first)."""
    from collections import Counter

    count, only, example = Counter(), Counter(), {}
    for r in results:
        s = summarize(r)
        if "verdict" in s:
            continue
        flags = list(dict.fromkeys(f for f, _ in s[variant]["blockers"]))
        if baseline:
            base = {f for f, _ in s[baseline]["blockers"]}
            flags = [f for f in flags if f not in base]
        for f in flags:
            count[f] += 1
            example.setdefault(f, dict(s[variant]["blockers"])[f])
        if len(flags) == 1:
            only[flags[0]] += 1
    lines = ["| flag | recipes blocked | the only blocker in | message (first 100 characters) |", "|---|---|---|---|"]
    for f, n in count.most_common():
        lines.append(f"| `{f}` | {n} | {only[f]} | {example[f][:100].replace('|', '/')} |")
    return "\n".join(lines)


def unlock_order(results: List[dict], variant: str = "edit_setup") -> str:
    """Greedy: which refused flag, once supported, lets the most further recipes through (a recipe
    counts once every flag that blocks it is supported)."""
    blocked = []
    for r in results:
        s = summarize(r)
        if "verdict" in s or s[variant]["verdict"] != "refused" or s[variant]["stuck"]:
            continue
        blocked.append(set(f for f, _ in s[variant]["blockers"]))
    supported: set = set()
    lines = ["| supporting also | recipes it lets through | accepted in all (of the refused ones) |", "|---|---|---|"]
    total = 0
    while True:
        gains = {}
        for flags in blocked:
            missing = flags - supported
            if len(missing) == 1:
                f = next(iter(missing))
                gains[f] = gains.get(f, 0) + 1
        remaining = [flags - supported for flags in blocked if flags - supported]
        if not remaining:
            break
        if not gains:  # every recipe left needs two or more: the flag most of them need
            for flags in remaining:
                for f in flags:
                    gains[f] = 0
            counts = {f: sum(f in m for m in remaining) for f in gains}
            best = max(counts, key=lambda f: (counts[f], f))
        else:
            best = max(gains, key=lambda f: (gains[f], f))
        supported.add(best)
        total += gains[best]
        lines.append(f"| `{best}` | {gains[best]} | {total} of {len(blocked)} |")
    return "\n".join(lines)


def verdict_counts(results: List[dict]) -> str:
    """How many recipes each variant accepts (and how many it could not judge)."""
    from collections import Counter

    lines = ["| variant | recipes | accepted | of those, with GPU-only flags not judged | refused | not judged "
             "(Megatron refuses the recipe itself) | error |", "|---|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        c, gpu = Counter(), 0
        for r in results:
            s = summarize(r)
            if "verdict" in s:
                c["error"] += 1
                continue
            v = s[variant]
            c[v["verdict"]] += 1
            gpu += v["verdict"] == "accepted" and bool(v["not_judged"])
        n = sum(c.values())
        lines.append(f"| {variant} | {n} | {c['accepted']} | {gpu} | {c['refused']} | "
                     f"{c['not judged (Megatron refuses it)']} | {c['error']} |")
    one_worker = sum(1 for r in results if "verdict" not in summarize(r)
                     and summarize(r)["as_shipped"]["verdict"] == "accepted"
                     and not summarize(r)["as_shipped"]["setup"] and summarize(r)["as_shipped"]["workers"] == 1)
    needs_setup = sum(1 for r in results if "verdict" not in summarize(r)
                      and summarize(r)["as_shipped"]["verdict"] == "accepted" and summarize(r)["as_shipped"]["setup"])
    lines.append("")
    lines.append(f"as_shipped accepted: {one_worker} without any added Megatron flag but with 1 worker (warned), "
                 f"{needs_setup} only after adding the set-up flags the refusal named")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("collect", "check"):
        q = sub.add_parser(name)
        q.add_argument("--megatron-lm", required=True)
        q.add_argument("--scratch", default=DEFAULT_SCRATCH)
        q.add_argument("--set", choices=("representative", "census"), default="representative",
                       help="representative: the shell recipes under examples/ and the chosen functional "
                            "tests; census: every GPT / MoE / Mixtral / hybrid training functional test")
        if name == "check":
            q.add_argument("--project", required=True, help="the megatron_edit checkout")
            q.add_argument("--python", default=sys.executable, help="the venv's interpreter")
            q.add_argument("--one-process", action="store_true",
                           help="all recipes of one script in one worker (the first through the launcher)")
            q.add_argument("--timeout", type=int, default=900)
            q.add_argument("--sync-interval", type=int, default=8, help="--local-sgd-sync-interval to add (H)")
            q.add_argument("--only", default=None, help="comma-separated recipe ids (default: the whole set)")
            q.add_argument("--out", required=True)
    t = sub.add_parser("table")
    t.add_argument("--results", required=True)
    t.add_argument("--no-rows", action="store_true", help="counts and rankings only (the census)")
    w = sub.add_parser("_worker")
    w.add_argument("--megatron-lm", required=True)
    w.add_argument("--specs", required=True)
    w.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.cmd == "_worker":
        return _worker(os.path.abspath(args.megatron_lm), args.specs, args.out)
    if args.cmd == "table":
        results = json.load(open(args.results))["results"]
        print(verdict_counts(results))
        print()
        if not args.no_rows:
            print(table(results))
        print()
        print(ranking(results))
        print()
        print(ranking(results, "a_edit", baseline="edit_setup"))
        print()
        print(unlock_order(results))
        return
    args.megatron_lm = os.path.abspath(args.megatron_lm)
    os.makedirs(args.scratch, exist_ok=True)
    recipes = collect_tests(args.megatron_lm, args.scratch, args.set)
    if args.set == "representative":
        recipes = collect_examples(args.megatron_lm, args.scratch) + recipes
    if args.cmd == "collect":
        json.dump(recipes, sys.stdout, indent=1)
        return
    args.project = os.path.abspath(args.project)
    if args.only:
        wanted = set(args.only.split(","))
        recipes = [r for r in recipes if r["id"] in wanted]
    for r in recipes:
        r["sync_interval"] = args.sync_interval
    bad = [r for r in recipes if "error" in r]
    recipes = [r for r in recipes if "error" not in r]
    t0 = time.time()
    results = _run_workers(args, recipes) + [{"id": r["id"], "path": r["path"], "source": r["source"],
                                             "worker_error": r["error"]} for r in bad]
    meta = {"megatron_lm": _git(args.megatron_lm), "project": _git(args.project), "set": args.set,
            "sync_interval": args.sync_interval,
            "one_process": args.one_process, "seconds": round(time.time() - t0, 1),
            "python": subprocess.run([args.python, "-c", "import sys, torch, megatron.core as m; "
                                      "print(sys.version.split()[0], torch.__version__, m.__version__)"],
                                     capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}
                                     ).stdout.strip()}
    json.dump({"meta": meta, "results": results}, open(args.out, "w"), indent=1)
    print(table(results))


def _git(path: str) -> str:
    r = subprocess.run(["git", "-C", path, "describe", "--tags", "--always"], capture_output=True, text=True)
    c = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True)
    return f"{r.stdout.strip()} ({c.stdout.strip()[:10]})"


if __name__ == "__main__":
    main()
