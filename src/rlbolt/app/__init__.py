"""The application layer: the `rlbolt` command (cli, cli_run, cli_export), YAML configs (config,
config_fields), config -> objects (build), run directories (rundir), the demo, and plots.
Nothing in the core imports from here except the ready LM modules, which read a RunConfig."""
