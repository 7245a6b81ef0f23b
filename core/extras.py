"""The optional extras of imgcls (pyproject.toml's [project.optional-dependencies]). A command or option that needs one
checks for it before importing it, so that without it the user reads one line naming the extra and the pip command
rather than an ImportError from deep inside a library."""

from __future__ import annotations

from importlib import metadata

from packaging.requirements import Requirement


class MissingExtraError(ImportError):
    """A command or option whose extra is not installed, or installed too old; its message is one line."""


def unmet(extra: str) -> list[str]:
    """What this environment lacks of `extra`'s requirements, each as `optuna not installed` or `wandb 0.30.0
    installed, >=0.31 needed`. Read from imgcls's installed metadata; none when imgcls is not installed (a checkout
    run from its folder), where the import that fails speaks for itself."""
    try:
        requires = metadata.requires("imgcls") or []
    except metadata.PackageNotFoundError:
        return []
    lacking = []
    for line in requires:
        requirement = Requirement(line)
        marker = requirement.marker
        # the extra's own requirements: their marker holds for this extra and not without it
        if marker is None or not marker.evaluate({"extra": extra}) or marker.evaluate({"extra": ""}):
            continue
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            lacking.append(f"{requirement.name} not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            lacking.append(f"{requirement.name} {installed} installed, {requirement.specifier} needed")
    return lacking


def require_extra(extra: str, what: str) -> None:
    """Raise MissingExtraError when `what` (a command, or a command with an option) cannot run for lack of `extra`."""
    lacking = unmet(extra)
    if lacking:
        raise MissingExtraError(f"{what} needs the `{extra}` extra: pip install 'imgcls[{extra}]' "
                                f"({'; '.join(lacking)})")
