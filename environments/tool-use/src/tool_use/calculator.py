"""The calculator, served by verifiers as an MCP tool server (``python -m tool_use.calculator``)."""

from __future__ import annotations

import verifiers.v1 as vf

from tool_use.data import evaluate


class CalculatorToolset(vf.Toolset[vf.SharedToolsetConfig]):
    # Tools reach the model as `calculator_<method>`.
    TOOL_PREFIX = "calculator"

    @vf.tool
    def evaluate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression (+ - * // % and parentheses) and return the result."""
        try:
            return str(evaluate(expression))
        except ValueError as e:
            return f"error: {e}"


if __name__ == "__main__":
    CalculatorToolset.run()
