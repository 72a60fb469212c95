//! TLS 1.3 on the TCP listeners (rustls with the ring provider). One port speaks both plaintext
//! and TLS: a TLS connection starts with a handshake record (byte 0x16), which neither protocol
//! can start with (a native frame that long is over any limit; a memcache command is text), so
//! the first byte tells which. Optional client certificates (mutual TLS) name their user by the
//! subject's common name.

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use tokio_rustls::TlsAcceptor;

/// The first byte of a TLS handshake record.
pub(crate) const HANDSHAKE_RECORD: u8 = 0x16;

/// What the listeners need to accept TLS.
pub(crate) struct Tls {
    pub acceptor: TlsAcceptor,
}

/// Reads the server's certificate chain and key, and the CA of client certificates if given.
pub(crate) fn load(cert: &Path, key: &Path, client_ca: Option<&Path>) -> Result<Tls, String> {
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .map_err(|e| format!("{}: {e}", cert.display()))?
        .collect::<Result<_, _>>()
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| format!("{}: {e}", key.display()))?;
    let provider = Arc::new(provider());
    let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match client_ca {
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).map_err(|e| format!("{}: {e}", ca.display()))? {
                roots
                    .add(c.map_err(|e| format!("{}: {e}", ca.display()))?)
                    .map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            // Clients without a certificate are let through to authenticate with a password.
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .allow_unauthenticated()
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder.with_single_cert(chain, key).map_err(|e| format!("{}: {e}", cert.display()))?;
    Ok(Tls { acceptor: TlsAcceptor::from(Arc::new(config)) })
}

/// ring's TLS 1.3 suites, AES-128-GCM first: as safe as AES-256 for this use and about a third
/// cheaper per byte, which shows at a few GB/s of messages.
pub(crate) fn provider() -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    provider
}

/// The user a verified client certificate names: its subject's common name.
pub(crate) fn certificate_user(connection: &rustls::ServerConnection) -> Option<String> {
    let cert = connection.peer_certificates()?.first()?;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let cn = parsed.subject().iter_common_name().next()?.as_str().ok()?.to_owned();
    Some(cn)
}
