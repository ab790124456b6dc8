"""Scraping a metrics endpoint: its samples by name and labels, many scrapes at once, the engines it failed to read."""

from __future__ import annotations

import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

ANSWER_WITHIN_S = 20.0
"""A scrape's promise is 10 s: a bound twice that is met on any machine, and missed by reads that wait their 30 s."""


def scrape(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200
        return response.read().decode()


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def failed_engines(samples: Samples) -> set[str]:
    """The engines a scrape counted in ``cmb_scrape_errors``."""
    return {dict(labels)["engine"] for (name, labels), v in samples.items() if name == "cmb_scrape_errors" and v == 1}


def scrapes_at_once(url: str, count: int) -> list[Samples]:
    """What ``count`` scrapes sent at once answered, each within :data:`ANSWER_WITHIN_S` (a later answer fails)."""
    start = threading.Barrier(count)

    def one(_: int) -> Samples:
        start.wait()
        return parse(scrape(url, timeout=ANSWER_WITHIN_S))

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))
