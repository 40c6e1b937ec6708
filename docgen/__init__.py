"""The documentation pages rendered from the code: ``python -m docgen`` writes them, ``--check`` says which differ.

One module per kind of page: :mod:`docgen.rest_api` (the PS's OpenAPI schema and refusal codes:
docs/reference/rest-api.md), :mod:`docgen.cli` (the argparse parser of every ``python -m`` command:
docs/reference/cli.md and docs/reference/cli-bench.md), and :mod:`bench.report` (the results table of
docs/performance.md, between its markers, from the newest ``make bench`` pass in bench/results/).
"""
