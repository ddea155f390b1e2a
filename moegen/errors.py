"""Exception hierarchy. Anything derived from MoegenError is reported by the CLI without a traceback."""
from __future__ import annotations


class MoegenError(Exception):
    """A failure moegen can explain to the user."""

    exit_code = 1


class UsageError(MoegenError):
    """A command asked for something it cannot do with these arguments or on this machine."""

    exit_code = 2


class SpecError(MoegenError):
    """A problem in a spec file: FILE:LINE:COL: field.path: what is wrong; how to fix it."""

    exit_code = 2

    def __init__(self, file: str, field: str, problem: str, fix: str, line: int = 0, col: int = 0):
        self.file, self.field, self.problem, self.fix = str(file), field, problem, fix
        self.line, self.col = line, col
        super().__init__(self.render())

    def render(self) -> str:
        where = f"{self.file}:{self.line}:{self.col}" if self.line else self.file
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.problem}; {self.fix}"


class SpecProblems(SpecError):
    """Every problem of one spec file, in document order. Its fields (file, field, line, ...) are
    the first problem's; the message is one line per problem."""

    def __init__(self, problems: list[SpecError]):
        self.problems = tuple(problems)
        first = self.problems[0]
        super().__init__(first.file, first.field, first.problem, first.fix, first.line, first.col)

    def render(self) -> str:
        return "\n".join(problem.render() for problem in self.problems)


class SettingError(MoegenError):
    """A MOEGEN_* environment variable moegen cannot use: NAME='value': what is wrong; how to fix it."""

    exit_code = 2

    def __init__(self, name: str, value: str, problem: str, fix: str):
        super().__init__(f"{name}={value!r}: {problem}; {fix}")


class BuildError(MoegenError):
    """The build could not complete; the previous output is untouched."""


class OutputError(MoegenError):
    """The build's destination holds something moegen did not write; nothing was changed."""

    exit_code = 2


class PackageError(MoegenError):
    """A generated package this moegen cannot run: rebuild it."""


class PlanError(MoegenError):
    """An offload plan file moegen cannot use: FILE: field: what is wrong; how to fix it."""

    exit_code = 2

    def __init__(self, file, field: str, problem: str, fix: str):
        self.file, self.field, self.problem, self.fix = str(file), field, problem, fix
        super().__init__(f"{self.file}: {field + ': ' if field else ''}{problem}; {fix}")
