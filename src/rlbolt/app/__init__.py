"""The application layer: the `rlbolt` command (cli, cli_run, cli_export), config -> objects
(build), run directories (rundir), and plots; the demo it runs is `rlbolt.demo`. Nothing below
this layer imports from here (tests/test_layering.py)."""
