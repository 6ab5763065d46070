"""CLI commands that use the engine directly: models, generate, tokenize."""
from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
