"""Gatehouse: an L7 inspecting proxy for the Apache Kafka wire protocol."""

__version__ = "0.1.0"
