"""The observation log: one record per request/response exchange (JSON Lines or Parquet).

    from gatehouse.capture.observer import CaptureObserver
    capture = CaptureObserver(settings, registry=metrics.registry)  # settings: parse_capture
    capture.attach(policy)      # the rules' decisions go into the records
    ...
    capture.close()             # flush: nothing is lost on a clean shutdown

``gatehouse.capture.schema`` (the versioned record schema, docs/capture.md) is pure and
is what the Spark pipeline reads with; it imports neither trio nor the proxy.
"""
