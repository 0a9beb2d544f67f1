"""The failures of the Proxmox modules, worded for the person running them.

Every module_utils file of the PVE side raises PveError for a failure the user can act on; the module turns
it into fail_json as is. api_error_text reads what PVE said out of a proxmoxer exception.
"""

from __future__ import annotations


class PveError(Exception):
    """A failure worth showing as is: it names what was seen and what to do."""


def api_error_text(exc):
    """The text of a proxmoxer ResourceException (status, message and per-field errors), or str(exc).

    >>> class Refused(Exception):
    ...     status_code, content, errors = 403, 'Permission check failed', {'dev0': 'only root@pam'}
    >>> api_error_text(Refused()), api_error_text(ConnectionResetError('reset by peer'))
    ("403 Permission check failed {'dev0': 'only root@pam'}", 'reset by peer')
    """
    content = getattr(exc, "content", None)
    if content is None:
        return str(exc)
    errors = getattr(exc, "errors", None)
    suffix = f" {errors}" if errors else ""
    return f"{exc.status_code} {content}{suffix}"
