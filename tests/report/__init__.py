"""Tests of tearless.report: diagnoses, the HTML report, compare and the CLI."""
