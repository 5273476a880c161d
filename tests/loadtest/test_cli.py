"""The command line end to end against the fake server: result file, plots, compare, sweep."""

import json

from loadtest import bench_concurrency, bench_prefix_cache, cli
from loadtest.result import load

PNG = b"\x89PNG\r\n\x1a\n"


def _strict_json(path):
    with open(path) as f:
        return json.load(f, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def _png(path):
    with open(path, "rb") as f:
        return f.read(8) == PNG


def test_run_writes_result_and_plots_then_compare(fake_server, tmp_path, capsys):
    common = [
        "--base-url",
        fake_server.url,
        "--num-requests",
        "4",
        "--output-tokens",
        "6",
        "--no-progress",
        "--slo-ttft-ms",
        "1000",
        "--slo-tpot-ms",
        "100",
    ]
    out1, out2 = tmp_path / "a.json", tmp_path / "b.json"
    assert (
        cli.main(
            [
                "run",
                *common,
                "--concurrency",
                "2",
                "--out",
                str(out1),
                "--plots",
                str(tmp_path / "p"),
                "--label",
                "closed2",
            ]
        )
        == 0
    )
    assert (
        cli.main(
            [
                "run",
                *common,
                "--rate",
                "inf",
                "--out",
                str(out2),
                "--label",
                "burst",
                "--workload",
                "multi-turn",
                "--turns",
                "2",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "TTFT ms" in text and "goodput" in text and "prefix cache" in text
    res = _strict_json(out1)
    assert res["schema_version"] == 1 and res["kind"] == "orbital.loadtest.result"
    assert res["aggregates"]["succeeded"] == 4 and res["aggregates"]["goodput"]["share"] == 1.0
    assert res["config"]["arrival"] == {"pattern": "closed", "concurrency": 2}
    assert len(res["requests"]) == 4 and res["requests"][0]["tpot"] > 0
    assert res["server_metrics"]["prefix_cache_hit_rate"] == 0.25  # from the fake /metrics
    series = res["server_series"]  # scraped during the run: the fake's gauges, one sample a second
    assert len(series["t"]) >= 1 and series["kv_cache_usage"][0] == 0.5
    assert all(v is not None and 0 <= v <= 2 for v in series["num_running"])  # concurrency 2
    assert "p95" in res["aggregates"]["ttft_ms"] and res["aggregates"]["request_tok_s"]["count"] == 4
    assert "running batch" in text and "p95" in text
    assert _strict_json(out2)["config"]["arrival"]["rate"] == "inf"
    assert _png(tmp_path / "p" / "latency_cdf.png") and _png(tmp_path / "p" / "throughput.png")
    assert _png(tmp_path / "p" / "server.png")

    assert (
        cli.main(
            ["compare", str(out1), str(out2), "--out", str(tmp_path / "cmp.json"), "--plots", str(tmp_path / "cp")]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "burst / closed2" in text and "TTFT p99 ms" in text and "x" in text
    cmp = _strict_json(tmp_path / "cmp.json")
    assert cmp["labels"] == ["closed2", "burst"]
    assert all(r["ratios"][0] in (1.0, None) for r in cmp["rows"])
    assert _png(tmp_path / "cp" / "compare_latency_cdf.png")
    assert cli.main(["compare", str(out1), str(out2), "--markdown"]) == 0
    assert capsys.readouterr().out.startswith("| metric | closed2 | burst |")
    assert cli.main(["plot", str(out1), "--out-dir", str(tmp_path / "pl")]) == 0
    assert _png(tmp_path / "pl" / "throughput.png")


def test_sweep_and_workload_commands(fake_server, tmp_path, capsys):
    d = tmp_path / "sw"
    assert (
        cli.main(
            [
                "sweep",
                "--base-url",
                fake_server.url,
                "--num-requests",
                "2",
                "--output-tokens",
                "4",
                "--values",
                "1,2",
                "--requests-per-unit",
                "2",
                "--out-dir",
                str(d),
                "--no-progress",
            ]
        )
        == 0
    )
    sw = _strict_json(d / "sweep.json")
    assert [p["aggregates"]["requests"] for p in sw["points"]] == [2, 4]
    assert load(str(d / "concurrency_2.json"))["aggregates"]["succeeded"] == 4
    assert _png(d / "sweep.png")
    assert cli.main(["plot", str(d / "sweep.json"), "--out-dir", str(tmp_path / "sp")]) == 0
    assert _png(tmp_path / "sp" / "sweep.png")
    capsys.readouterr()
    assert cli.main(["workload", "--workload", "shared-prefix", "-n", "3", "--prefix-tokens", "30"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(json.loads(x)["kind"] == "prefix0" for x in lines)


def test_bench_scripts_against_a_running_server(fake_server, tmp_path, capsys):
    d = tmp_path / "bc"
    assert (
        bench_concurrency.main(
            [
                "--base-url",
                fake_server.url,
                "--tokenizer",
                "approx",
                "--values",
                "1,2",
                "--num-requests",
                "2",
                "--requests-per-unit",
                "1",
                "--output-tokens",
                "3",
                "--out-dir",
                str(d),
                "--no-progress",
            ]
        )
        == 0
    )
    assert (d / "table.md").read_text().startswith("| concurrency |")
    assert _png(d / "sweep.png") and _png(d / "latency_cdf.png")
    d = tmp_path / "bp"
    assert (
        bench_prefix_cache.main(
            [
                "--base-url",
                fake_server.url,
                "--tokenizer",
                "approx",
                "--num-requests",
                "3",
                "--prefix-tokens",
                "40",
                "--output-tokens",
                "3",
                "--out-dir",
                str(d),
                "--no-progress",
            ]
        )
        == 0
    )
    table = (d / "table.md").read_text()
    assert "| on |" in table and "| off |" in table and "25.0%" in table
    assert _png(d / "compare_latency_cdf.png")
