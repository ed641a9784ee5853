"""What an S3 error answer means: one ladder from (HTTP status, S3 error code, message) to the
`cause` of the sidecar's error, shared by the S3 client calls (s3_client.py) and the ranged GETs
of the bytes (httpranges.py), and which causes mean the registry is not ready. Each caller words
the error for what it was doing.
"""

from __future__ import annotations

# S3's answers to a signature or session token past its expiry (a presigned URL's
# X-Amz-Expires, or short-lived credentials from STS or IRSA): signing again is the cure.
EXPIRED_CODES = ("ExpiredToken", "TokenRefreshRequired", "RequestExpired")
CREDENTIAL_CODES = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken")
# Refusals every call would get, whatever the adapter: the sidecar is not ready (readiness
# names the cause) until a call to the registry succeeds again.
NOT_READY_CAUSES = frozenset(
    ("credentials", "credentials_expired", "clock", "permission", "bucket", "not_s3"))


def s3_cause(status: int, code: str, message: str = "", *, head: bool = False) -> str:
    """The cause of an S3 error answer: not_s3, object_changed, credentials_expired, clock,
    credentials, permission, bucket, server or refused. `head`: a HEAD's answer, which never
    has a body (so a bare 404 is a missing object, not a server that does not speak S3)."""
    if status == 404 and (not code or code.isdigit()) and not head:
        # S3 answers every 404 but a HEAD's with an XML error naming its code; botocore
        # gives the bare status as the code when there is none.
        return "not_s3"
    if status == 412 or code in ("PreconditionFailed", "NoSuchKey"):
        return "object_changed"
    if code in EXPIRED_CODES or (
            status == 403 and code == "AccessDenied" and "expired" in message.lower()):
        return "credentials_expired"
    if code == "RequestTimeTooSkewed":
        return "clock"
    if code in CREDENTIAL_CODES:
        return "credentials"
    if code in ("AccessDenied", "AllAccessDisabled") or status == 403:
        return "permission"
    if code == "NoSuchBucket":
        return "bucket"
    if status == 404:
        return "object_changed"
    if status >= 500 or status == 429 or code in ("SlowDown", "InternalError",
                                                  "ServiceUnavailable"):
        return "server"
    return "refused"
