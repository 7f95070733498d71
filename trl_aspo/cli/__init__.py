"""The `trl-aspo` command line: `train`, `evaluate`, `values`, `compare`, `plot`
(entry point: `trl_aspo.cli.main:main`)."""
