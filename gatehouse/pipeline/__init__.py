"""``gatehouse report``: the observation log through PySpark into Parquet tables and a page.

    from gatehouse.pipeline.job import ReportOptions, run_report
    run_report(ReportOptions(captures="capture/", out=Path("report/"), rules=ruleset))

Pure Python plus PySpark; never imports trio or the proxy.  The rules' decisions come
from ``gatehouse.rules`` itself (``gatehouse.pipeline.impact``).
"""
