"""CLI command for bulk summarisation: summarize."""
from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
