"""CLI commands for the queue: submit, worker, collect, watch, status."""
from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
