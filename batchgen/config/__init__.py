"""Job configuration: the JobConfig record, its rules, and the choices shared by config, CLI and engine. No torch."""
