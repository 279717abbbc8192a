"""eval.bench_traffic on the shipped llada-small: every pass compiles nothing, its per-kind
latencies cover every request, and the timed pass says where each policy's device time went."""

import json

from eval.bench_traffic import group_label, main


def test_passes_groups_and_timed_breakdown(tmp_path, capsys):
    out = tmp_path / "traffic.json"
    assert main(["--model", "acache_jax/models/llada-small", "--requests", "8", "--rate", "50", "--max-batch", "2",
                 "--gen-lengths", "32", "--min-affix-reuse", "1000000", "--timed", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    names = ["baseline", "acache", "acache_min_reuse_1000000"]
    for name in names:
        run = result[name]["passes"]["50.0"]
        assert run["compiles"] == 0  # the warm-up compiled every program the pass needed
        assert sum(g["n"] for g in run["groups"].values()) == 8
        assert all(0 < g["p50_s"] <= g["p99_s"] for g in run["groups"].values())
    no_affix = group_label(0, 32, as_dual=False)
    with_affix = 8 - result["baseline"]["passes"]["50.0"]["groups"].get(no_affix, {"n": 0})["n"]
    assert with_affix > 0 and result["acache_min_reuse_1000000"]["requests_as_dual"] == with_affix
    # every label of the rule's pass says "as dual" where the request has an affix
    rule_groups = result["acache_min_reuse_1000000"]["passes"]["50.0"]["groups"]
    assert all(("as dual" in g) == (g != no_affix) for g in rule_groups)
    # the table on stderr: a row per kind of request, a cell per pass, the rule's dual kinds marked
    err = capsys.readouterr().err.splitlines()
    table = err[next(i for i, line in enumerate(err) if line.startswith("rate 50/s: p50 / p99 ms")):]
    assert table[0].split()[-3:] == names
    base = result["baseline"]["passes"]["50.0"]
    assert table[2].split()[2:4] == [f"{base['p50_s'] * 1e3:.1f}", "/"]
    for label, group in base["groups"].items():
        row = next(r for r in table if r.startswith(f"{label} (n={group['n']})"))
        assert row.count(" / ") == 3 and row.endswith("*") == (label != no_affix)
    calls = {name: result[name]["timed"]["calls"] for name in names}
    # only ACache probes; a rule that runs every request as dual leaves its engine the baseline's calls
    assert any("probe" in kind for kind in calls["acache"])
    assert not any("probe" in kind for kind in calls["baseline"] | calls["acache_min_reuse_1000000"])
    for name in names:
        assert all(c["n"] > 0 and 0 < c["median_s"] <= c["seconds"] for c in calls[name].values())
        assert sum(c["seconds"] for c in calls[name].values()) <= result[name]["timed"]["seconds"]
