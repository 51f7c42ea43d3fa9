"""bench/decoder_profile.py on the CPU: the decoder's calls listed and the bias gradients' column sums timed, so
that the script cannot rot."""

import json


def test_decoder_profile_lists_the_decoders_calls_and_times_the_column_sums(tmp_path, load_bench):
    out = tmp_path / "decoder.json"
    report = load_bench("decoder_profile").main(
        ["--json", str(out), "--rows", "2048", "--rays", "256", "--steps", "1", "--repeats", "3"]
    )
    assert json.loads(out.read_text()) == report
    (run,) = report["runs"]
    assert run["rows"] == 2048 and run["rays"] == 256
    calls = {row["call"] for row in run["calls"]}  # the CPU's own time here
    assert "cuda_ext::gelu_rows_backward" in calls and "aten::mm" in calls
    assert set(run["column_sums_ms"]) == {"(N, 256)", "(N, 8)", "(B, 256)"}
    assert all(ms > 0 for sums in run["column_sums_ms"].values() for ms in sums.values())
