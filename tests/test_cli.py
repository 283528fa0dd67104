"""The command line: bad input gets one clear line and exit status 2, never a traceback."""
import subprocess
import sys

import pytest

from minillm.cli import main


@pytest.mark.parametrize("argv,needle", [
    (["generate", "--model", "nosuch", "hi"], "neither a preset"),
    (["generate", "--dtype", "int8", "hi"], "unknown dtype"),
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["roofline", "--batches", "0,2"], "batch sizes"),
    (["serve", "--port", "99999"], "port"),
])
def test_bad_input_is_one_clear_error(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_generate_streams_and_reports_metrics():
    r = subprocess.run([sys.executable, "-m", "minillm", "generate", "--model", "tiny", "--max-tokens", "8",
                        "--device", "cpu", "hello"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    for word in ("TTFT", "TPOT", "tok/s", "bandwidth"):
        assert word in r.stderr
