"""The output's manifest: which parts are committed, under which job config, as entries and snapshots."""
