"""The soak's verdict (``bench/steady.py``, aim 7): sizes that keep growing fail it, the sawtooth
of vacuum truncations does not."""

from __future__ import annotations

from bench.steady import Sample, verdict

RATE = 1000.0


def _run(table_mb: list[float]) -> list[Sample]:
    return [
        Sample(
            minute=float(minute),
            drained_per_second=RATE,
            pending=0,
            claim_ms=4.0,
            table_mb=size,
            index_mb=80.0,
            resident_mb=77.0,
        )
        for minute, size in enumerate(table_mb, start=1)
    ]


# A table's size between vacuum truncations: it grows for five minutes, then drops back.
SAWTOOTH = [70.0, 75.0, 80.0, 85.0, 90.0] * 12


def test_a_sawtooth_that_stays_in_its_band_holds():
    assert verdict(_run(SAWTOOTH), RATE) == []


def test_one_sample_at_the_top_of_a_tooth_is_not_growth():
    # The first soak hour of the twenty-second round: one two-minute spike near the end, back
    # in the band a minute later. A verdict on peaks alone failed it.
    sizes = list(SAWTOOTH)
    sizes[56], sizes[57] = 103.0, 95.0

    assert verdict(_run(sizes), RATE) == []


def test_a_band_that_keeps_rising_is_growth():
    sizes = [size + minute for minute, size in enumerate(SAWTOOTH)]

    assert verdict(_run(sizes), RATE) == [
        "tables still growing: means of 117.0 MB, then 132.0 MB; peaks of 134.0 MB, then 149.0 MB"
    ]


def test_a_drain_that_falls_behind_fails_whatever_the_sizes():
    samples = _run([70.0] * 60)
    samples[-15:] = [
        Sample(s.minute, 800.0, 12_000, s.claim_ms, s.table_mb, s.index_mb, s.resident_mb)
        for s in samples[-15:]
    ]

    assert verdict(samples, RATE) == ["the drain fell behind: 800/s against 1,000/s"]
