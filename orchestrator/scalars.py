"""Strict scalar types for spec fields: ``true`` is not 1 and ``"5"`` is not 5.

A typo in a spec file must be refused at submit, not become a limit. Numbers from
YAML and JSON keep working: an int is an int, and an int is also a valid float.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Strict

Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict still takes an int (300 -> 300.0), never a bool or str
Bool = Annotated[bool, Strict()]
