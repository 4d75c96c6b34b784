"""The soak tool's arithmetic (no server): gaps during heavy hostile requests against the median,
RSS drift, failures and targets; and its command line."""

from __future__ import annotations

import pytest

from glm5_client.hostile import KINDS, HostileFactory, HostileOutcome
from glm5_client.soak import SoakResult, StreamRecord, _pcts, build_parser, main


def result(**kw) -> SoakResult:
    streams = [StreamRecord(started=0.0, arrivals=[0.1, 0.2, 0.3, 0.4, 0.5], tokens=5),
               StreamRecord(started=1.0, arrivals=[1.1, 1.2, 2.1, 2.2], tokens=4),       # one 0.9 s gap
               StreamRecord(started=3.0, arrivals=[3.1], tokens=1, cancelled=True),
               StreamRecord(started=4.0, error="boom")]
    hostile = [HostileOutcome("huge_prompt", True, "refused", 1.25, 2.0),
               HostileOutcome("bad_params", False, "served {}", 0.0, 0.1)]
    defaults = dict(settings={}, streams=streams, hostile=hostile, samples=[], cache_after=0.0,
                    rss_baseline=1000 * 2**20, rss_final=1030 * 2**20, duration_s=5.0)
    defaults.update(kw)
    return SoakResult(**defaults)


def test_summary_counts_failures_cancellations_and_the_heavy_gap():
    s = result().summary()
    assert (s["good_requests"], s["failed_good_requests"], s["cancelled_requests"]) == (3, 1, 1)
    assert s["failure_messages"] == ["boom"]
    assert s["inter_token_gap_s"]["p50"] == pytest.approx(0.1)
    assert s["max_gap_during_heavy_hostile_s"] == pytest.approx(0.9)       # 1.2 -> 2.1 overlaps 1.25..2.0
    assert s["gap_ratio_heavy_vs_median"] == pytest.approx(9.0)
    assert s["rss_drift"] == pytest.approx(0.03)
    assert s["hostile"] == {"huge_prompt": {"sent": 1, "handled": 1}, "bad_params": {"sent": 1, "handled": 0}}


def test_verdict_applies_the_targets():
    v = result().verdict()
    assert v == {"no_failed_good_requests": False, "rss_drift_within_5pct": True, "cache_empty_after": True,
                 "heavy_gap_within_10x_median": True, "hostile_requests_handled": False}
    v = result(rss_final=1100 * 2**20, cache_after=0.25, rss_baseline=None).verdict()
    assert v["rss_drift_within_5pct"] is None and v["cache_empty_after"] is False


def test_percentiles():
    d = _pcts([float(i) for i in range(1, 101)])
    assert (d["n"], d["p50"], d["p99"], d["max"]) == (100, 51.0, 99.0, 100.0)
    assert _pcts([]) is None


def test_hostile_requests_are_built_for_every_kind():
    f = HostileFactory()
    for kind in KINDS:
        if kind in ("oversized_http", "video_720p", "huge_prompt"):
            continue                            # sent by the tool itself / expensive to build here
        req = f.build(kind)
        assert req.kind == kind and req.must_fail
    assert len(f.prompt()) >= 9_900_000
    with pytest.raises(ValueError, match="unknown hostile kind"):
        f.build("nope")


def test_command_line_is_checked(capsys):
    assert main(["--hostile-kinds", "bad_params,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    assert main(["--streams", "0"]) == 2
    args = build_parser().parse_args(["--streams", "64", "--minutes", "10", "--hostile", "--cancel-fraction", "0.1"])
    assert (args.streams, args.minutes, args.hostile, args.cancel_fraction) == (64, 10.0, True, 0.1)
