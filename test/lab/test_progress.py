"""The benchmarks' progress off a terminal: lines in the log instead of a bar."""

from sgl_ecospec.lab.bench.runs import Progress


def test_off_a_terminal_progress_writes_lines_at_most_every_interval(capsys):
    progress = Progress(3, interval=3600.0)
    assert progress.bar.disable  # pytest's stderr is not a terminal
    progress.describe("adaptive batch 1")
    progress.on_step(None)
    progress.advance()
    assert capsys.readouterr().err == ""  # within the interval: quiet
    progress.advance(2)  # the last batch: always one line
    err = capsys.readouterr().err
    assert err.startswith("progress: 3/3 batches, adaptive batch 1: 1 verify steps, ")
    progress.close()


def test_off_a_terminal_a_long_batch_still_reports_its_verify_steps(capsys):
    progress = Progress(1, interval=0.0)
    progress.describe("greedy batch 64")
    progress.on_step(None)
    progress.on_step(None)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(": ")[2].split(",")[0] for line in lines] == [
        "1 verify steps",
        "2 verify steps",
    ]
    assert all(line.startswith("progress: 0/1 batches, greedy batch 64") for line in lines)
