"""OTLP metrics (a KIP-714 push's payload) written by OpenTelemetry's own generated
protobuf classes (``opentelemetry-proto``), never by the reader under test."""

from __future__ import annotations

from typing import Any

from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.metrics.v1 import metrics_pb2


def kv(key: str, **value: Any) -> common_pb2.KeyValue:
    return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(**value))


def metrics_data(*metrics: metrics_pb2.Metric,
                 resource: tuple[common_pb2.KeyValue, ...] = ()) -> bytes:
    data = metrics_pb2.MetricsData()
    rm = data.resource_metrics.add()
    rm.resource.attributes.extend(resource)
    rm.scope_metrics.add().metrics.extend(metrics)
    return data.SerializeToString()


def gauge(name: str, value: float, *attributes: common_pb2.KeyValue) -> metrics_pb2.Metric:
    metric = metrics_pb2.Metric(name=name)
    metric.gauge.data_points.add(as_double=value, attributes=attributes)
    return metric


def counter(name: str, value: int, *attributes: common_pb2.KeyValue,
            monotonic: bool = True) -> metrics_pb2.Metric:
    metric = metrics_pb2.Metric(name=name)
    metric.sum.aggregation_temporality = metrics_pb2.AGGREGATION_TEMPORALITY_CUMULATIVE
    metric.sum.is_monotonic = monotonic
    metric.sum.data_points.add(as_int=value, attributes=attributes, time_unix_nano=123)
    return metric
