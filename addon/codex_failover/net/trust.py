"""What upstream TLS trusts: certifi's CAs (mitmproxy's default) plus the machine's own trust store.

Behind a TLS-inspecting corporate egress the inspecting CA is in the system store, not in certifi:
trusting only certifi failed every model request there. The system store is the file and directory
OpenSSL users name with SSL_CERT_FILE / SSL_CERT_DIR, else the distribution's bundle. Finding the
paths is pure (environment and file test injected); loading them into a context is not.
See docs/machine-proxy.md.
"""

from __future__ import annotations

import os
import ssl
from typing import Callable, Mapping

Locations = tuple[str | None, str | None]  # (cafile, capath)

# Where distributions keep the system bundle, first match wins (the list Go's crypto/x509 uses).
SYSTEM_BUNDLES = (
    "/etc/ssl/certs/ca-certificates.crt",  # Debian, Ubuntu, Arch, Gentoo
    "/etc/pki/tls/certs/ca-bundle.crt",  # Fedora, RHEL
    "/etc/ssl/ca-bundle.pem",  # openSUSE
    "/etc/pki/tls/cacert.pem",  # OpenELEC
    "/etc/pki/ca-trust/extracted/pem/tls-ca-bundle.pem",  # CentOS, RHEL 7
    "/etc/ssl/cert.pem",  # macOS, Alpine, the BSDs
)


def system_locations(environ: Mapping[str, str] | None = None,
                     is_file: Callable[[str], bool] = os.path.isfile,
                     is_dir: Callable[[str], bool] = os.path.isdir) -> Locations:
    """(cafile, capath) of the machine's trust store; either may be None."""
    env = os.environ if environ is None else environ
    cafile = env.get("SSL_CERT_FILE") or next((p for p in SYSTEM_BUNDLES if is_file(p)), None)
    if cafile and not is_file(cafile):
        cafile = None
    capath = env.get("SSL_CERT_DIR") or None
    if capath and not is_dir(capath):
        capath = None
    return cafile, capath


def add_system_trust(context: ssl.SSLContext, locations: Locations | None = None) -> None:
    """Load the system store into an `ssl.SSLContext` (added to what it trusts already). A store that
    cannot be read is skipped: certifi still applies, and a failed verification fails closed."""
    for cafile, capath in _each(system_locations() if locations is None else locations):
        try:
            context.load_verify_locations(cafile, capath)
        except (ssl.SSLError, OSError):
            pass


def extend_openssl_context(context, locations: Locations | None = None) -> None:
    """The same for a pyOpenSSL `SSL.Context` that mitmproxy has built, cached and already used for
    the connection at hand. pyOpenSSL refuses to change a used context (a guard against threads;
    mitmproxy's event loop has one), so this calls OpenSSL's own function on it, as mitmproxy's
    tlsconfig does for hostname checks. OpenSSL consults the context's store when the handshake
    verifies, so the connection at hand sees the addition. See docs/mitmproxy-12.3.1-replay-notes.md §8."""
    from OpenSSL import SSL

    for cafile, capath in _each(system_locations() if locations is None else locations):
        SSL._lib.SSL_CTX_load_verify_locations(  # returns 0 on an unreadable store: skipped, as above
            context._context, cafile.encode() if cafile else SSL._ffi.NULL, capath.encode() if capath else SSL._ffi.NULL)
        SSL._lib.ERR_clear_error()


def _each(locations: Locations):
    cafile, capath = locations
    if cafile:
        yield cafile, None
    if capath:
        yield None, capath
