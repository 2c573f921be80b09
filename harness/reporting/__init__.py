"""Reporting: run directories in, tables, figures and REPORT.md out.

``results`` reads runs into tidy frames; ``stats`` makes the intervals; ``tables`` and ``figures`` draw; the
``report`` module writes them all for one sweep.
"""
