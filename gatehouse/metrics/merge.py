"""Several workers' /metrics as one exposition: each sample labelled with its worker.

The supervisor of ``workers: N`` serves this on the config's metrics address, so
Prometheus scrapes one endpoint per host as with one process.  Samples are labelled, not
summed: a sum is right for counters but not for every gauge (``process_start_time``),
and the dashboard's queries already sum over what they do not name.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

WORKER_LABEL = "worker"


class _Families:
    """What ``generate_latest`` needs of a registry: ``collect()``."""

    def __init__(self, families: Sequence[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_by_worker(expositions: Iterable[tuple[str, str]],
                    own: Sequence[Metric] = ()) -> bytes:
    """``expositions``: (worker, Prometheus text) pairs -> one text exposition in which
    every sample carries ``worker``; ``own`` families (the supervisor's) go first."""
    families: dict[str, Metric] = {family.name: family for family in own}
    for worker, text in expositions:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit)
            merged.samples.extend(
                sample._replace(labels={**sample.labels, WORKER_LABEL: worker})
                for sample in family.samples)
    return generate_latest(_Families(list(families.values())))
