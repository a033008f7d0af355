"""`run --help` (and `plan --help`) in sections: Input, Prompt, Model, Sampling, Output, Engine, ...

Each option names its section with Typer's `rich_help_panel` (cli/options.py). The app renders
plain click help (cli/app.py says why: rich markup eats the "[default]" texts), and plain click
help ignores panels, so PanelCommand writes one help section per panel itself, in PANELS order.
"""

from __future__ import annotations

import click
from typer.core import TyperCommand

# the order of the sections in --help; options without a panel (--config, --help) come last
PANELS = ("Input", "Prompt", "Model", "Sampling", "Output", "Engine", "Sharding and executors", "Monitoring", "Plan")
OTHER = "Options"


class PanelCommand(TyperCommand):
    """A Typer command whose --help lists its options under their rich_help_panel headings."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                sections.setdefault(getattr(param, "rich_help_panel", None) or OTHER, []).append(record)
        for name in (*PANELS, OTHER):
            if name in sections:
                with formatter.section(name):
                    formatter.write_dl(sections[name])
