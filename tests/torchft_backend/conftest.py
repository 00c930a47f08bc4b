"""The torchft tests' own hook: a test whose job died in native code runs again.

A torchft test starts several jobs (one per worker) and a Lighthouse, so a job cannot be run
again alone as :func:`dist.run_ranks` does: the whole test is, under the same rule
(:func:`dist.run_again`: only when a rank died in native code, the known defect of issue 62, up
to :data:`dist.RUNS` runs, each rerun counted and said as a warning with its reason). A test that
writes into ``tmp_path`` (markers a relaunch waits for) is not run again: its second run would
find the first's files."""

import pytest

from dist import RankError, run_again


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    names = pyfuncitem._fixtureinfo.argnames
    if "tmp_path" in names or "tmpdir" in names:
        return None  # (pytest's own call)
    args = {name: pyfuncitem.funcargs[name] for name in names}
    attempt = 1
    while True:
        try:
            pyfuncitem.obj(**args)
            return True
        except RankError as error:
            if not run_again(error, attempt):
                raise
            attempt += 1
