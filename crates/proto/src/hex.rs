//! Hex strings for byte fields in JSON (test vectors are JSON, bytes are hex).

fn to_hex(b: &[u8]) -> String {
    ::hex::encode(b)
}

fn from_hex<E: serde::de::Error>(s: &str) -> Result<Vec<u8>, E> {
    ::hex::decode(s).map_err(E::custom)
}

pub(crate) mod bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(b: &::bytes::Bytes, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::to_hex(b))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<::bytes::Bytes, D::Error> {
        Ok(super::from_hex(&String::deserialize(d)?)?.into())
    }
}

pub(crate) mod headers {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(h: &[(String, ::bytes::Bytes)], s: S) -> Result<S::Ok, S::Error> {
        h.iter().map(|(n, v)| (n.clone(), super::to_hex(v))).collect::<Vec<_>>().serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<(String, ::bytes::Bytes)>, D::Error> {
        Vec::<(String, String)>::deserialize(d)?
            .into_iter()
            .map(|(n, v)| Ok((n, super::from_hex(&v)?.into())))
            .collect()
    }
}

/// Hex encoding of whole frames, for test vectors and debugging.
pub fn encode(b: &[u8]) -> String {
    to_hex(b)
}

/// Parses a hex string.
pub fn decode(s: &str) -> Result<Vec<u8>, String> {
    from_hex::<serde::de::value::Error>(s).map_err(|e| e.to_string())
}
