"""An installed app whose ``work_handlers`` module imports a library this machine lacks (the
newcomer's mistake helper-158 made: a typo, or a worker dependency not installed)."""
