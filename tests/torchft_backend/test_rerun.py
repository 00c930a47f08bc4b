"""The torchft tests' rerun (conftest.py here): a test whose job died in native code runs again,
counted and said (issue 62's known defect, as tests/dist.py's run_ranks does for one job)."""

import pytest

from dist import NATIVE_CRASH, RERUNS, RankError, run_again

_CALLS: list = []


def test_a_torchft_test_whose_job_died_in_native_code_runs_again():
    """The first call fails as a torchft test whose rank died by SIGSEGV does; the hook runs the
    test again, and has counted the rerun (taken out here: the harness's own is not the suite's)."""
    _CALLS.append(len(RERUNS))
    if len(_CALLS) == 1:
        raise RankError("rank 1 exited with code -11 without reporting (its job's peer: Connection closed by peer)")
    assert len(_CALLS) == 2 and len(RERUNS) == _CALLS[0] + 1, (_CALLS, RERUNS)
    assert RERUNS[-1][0].endswith("test_a_torchft_test_whose_job_died_in_native_code_runs_again")
    assert RERUNS[-1][1] == "a rank died in native code"
    del RERUNS[-1]


def test_only_a_native_crash_runs_again_and_at_most_the_runs_allowed():
    before = len(RERUNS)
    assert not run_again(RankError("rank 0 failed: AssertionError: wrong numbers"), 1)
    assert not run_again(RankError(NATIVE_CRASH[0]), 3)  # the last run's crash is raised
    with pytest.warns(UserWarning, match="died in native code"):
        assert run_again(RankError(NATIVE_CRASH[1]), 1)
    assert len(RERUNS) == before + 1
    del RERUNS[before:]
