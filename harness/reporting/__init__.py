"""Reporting: run directories in, tables, figures and REPORT.md out.

``results`` reads runs into tidy frames; ``stats`` makes the intervals; ``items`` is the registry the ``tables``
and ``figures`` packages register into when imported (one module per topic); ``render`` formats tables as
Markdown and LaTeX; the ``report`` module imports both packages and writes everything for one sweep.
"""
