"""What the data, the model and the run layer all use: hardware detection (`core.hardware`), the typed config values
(`core.config_types`), the seeds of random draws (`core.seeding`), the packages' names imported on first use
(`core.lazy`), and the command line of every command (`core.command_line`, `core.parse_errors`). It imports none of
the three."""
