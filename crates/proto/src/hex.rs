//! Hex strings for byte fields in JSON (test vectors are JSON, bytes are hex).

fn to_hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn from_hex<E: serde::de::Error>(s: &str) -> Result<Vec<u8>, E> {
    if !s.len().is_multiple_of(2) {
        return Err(E::custom("odd-length hex"));
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(E::custom)).collect()
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
