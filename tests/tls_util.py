"""A self-signed certificate for the TLS tests (openssl CLI): valid for 127.0.0.1 and localhost,
its own CA."""
import subprocess


def self_signed(d, name: str = "localhost") -> tuple[str, str]:
    """-> (cert path, key path) written in directory d."""
    cert, key = str(d / f"{name}.pem"), str(d / f"{name}.key")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
                    "-out", cert, "-days", "1", "-subj", f"/CN={name}",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return cert, key
