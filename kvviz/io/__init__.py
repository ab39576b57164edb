"""The ways out: what every CLI subcommand shares (clirun), JSON/HTML export and reopen, repro scripts, the
architecture sweep's report."""
