//! Request signing (PROTOCOL.md, "Request signing").
//!
//! The signature is the lowercase hex HMAC-SHA256 of `path + ":" + message`,
//! keyed with a shared secret, carried in the `sentry-signature` metadata.
//! Several secrets may be configured so they can be rotated: a request
//! matching any of them is accepted, and outgoing requests use the first.

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// The gRPC metadata key that carries the signature.
pub const SIGNATURE_METADATA: &str = "sentry-signature";

type HmacSha256 = Hmac<Sha256>;

fn mac(secret: &str, path: &str, message: &[&[u8]]) -> HmacSha256 {
    // HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(secret.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
    mac.update(path.as_bytes());
    mac.update(b":");
    for part in message {
        mac.update(part);
    }
    mac
}

/// The signature of `message` sent to `path` (e.g.
/// `/sentry_protos.taskbroker.v1.WorkerService/PushTask`), as lowercase hex.
pub fn sign(secret: &str, path: &str, message: &[u8]) -> String {
    sign_parts(secret, path, &[message])
}

/// [`sign`] for a message held in several consecutive buffers, so the
/// caller need not copy them into one.
pub fn sign_parts(secret: &str, path: &str, message: &[&[u8]]) -> String {
    let digest = mac(secret, path, message).finalize().into_bytes();
    let mut hex = String::with_capacity(digest.len() * 2);
    for byte in digest {
        hex.push(char::from(HEX[usize::from(byte >> 4)]));
        hex.push(char::from(HEX[usize::from(byte & 0x0f)]));
    }
    hex
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// Whether `signature` (hex, either case) signs `message` for `path` with
/// any of `secrets`. The comparison is constant-time per secret.
pub fn verify(secrets: &[String], path: &str, message: &[u8], signature: &str) -> bool {
    let Some(expected) = decode_hex(signature) else {
        return false;
    };
    secrets.iter().any(|secret| {
        mac(secret, path, &[message])
            .verify_slice(&expected)
            .is_ok()
    })
}

fn decode_hex(text: &str) -> Option<Vec<u8>> {
    let text = text.as_bytes();
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let nibble = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    text.chunks_exact(2)
        .map(|pair| Some(nibble(pair[0])? << 4 | nibble(pair[1])?))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PUSH_PATH: &str = "/sentry_protos.taskbroker.v1.WorkerService/PushTask";

    #[test]
    fn matches_the_protocol_test_vector() {
        assert_eq!(
            sign("super secret", PUSH_PATH, b"hello"),
            "cfdf2c4d2efd3a2d28bd10de6471ef352d03f49d2d3bd880ee7051ea39fbe239"
        );
    }

    #[test]
    fn signing_parts_equals_signing_the_whole() {
        assert_eq!(
            sign_parts("k", PUSH_PATH, &[b"he", b"", b"llo"]),
            sign("k", PUSH_PATH, b"hello")
        );
    }

    #[test]
    fn verifies_with_any_configured_secret() {
        let signature = sign("new", PUSH_PATH, b"body");
        let secrets = vec!["old".to_owned(), "new".to_owned()];
        assert!(verify(&secrets, PUSH_PATH, b"body", &signature));
        assert!(verify(
            &secrets,
            PUSH_PATH,
            b"body",
            &signature.to_uppercase()
        ));
    }

    #[test]
    fn rejects_wrong_secret_path_body_or_malformed_hex() {
        let secrets = vec!["super secret".to_owned()];
        let signature = sign("super secret", PUSH_PATH, b"hello");
        assert!(!verify(
            &["other".to_owned()],
            PUSH_PATH,
            b"hello",
            &signature
        ));
        assert!(!verify(&secrets, "/other/Path", b"hello", &signature));
        assert!(!verify(&secrets, PUSH_PATH, b"hellO", &signature));
        assert!(!verify(&secrets, PUSH_PATH, b"hello", &signature[..10]));
        assert!(!verify(&secrets, PUSH_PATH, b"hello", "zz"));
        assert!(!verify(&secrets, PUSH_PATH, b"hello", "abc"));
        assert!(!verify(&secrets, PUSH_PATH, b"hello", ""));
        assert!(!verify(&[], PUSH_PATH, b"hello", &signature));
    }
}
