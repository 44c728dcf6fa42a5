//! The protobuf codec of the generated gRPC code (`build.rs` names it with
//! `codec_path`): tonic_prost's codec, except that a message that does not
//! decode is INVALID_ARGUMENT rather than INTERNAL.
//!
//! A request with bytes that are not the message, or a string field that is
//! not UTF-8, is the caller's mistake: INVALID_ARGUMENT tells a worker not
//! to send it again, while INTERNAL reads as the broker's fault and invites
//! retries. The generated clients (tests, the demo worker) use the same
//! codec, so a response that does not decode is INVALID_ARGUMENT there too;
//! the broker's own PushTask client decodes by hand (`worker_client.rs`).

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// Encodes `T`, decodes `U`, as [`ProstCodec`] does.
#[derive(Debug, Clone)]
pub struct WireCodec<T, U> {
    inner: ProstCodec<T, U>,
}

impl<T, U> Default for WireCodec<T, U> {
    fn default() -> Self {
        WireCodec {
            inner: ProstCodec::default(),
        }
    }
}

impl<T, U> Codec for WireCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = WireDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.inner.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        WireDecoder {
            inner: self.inner.decoder(),
        }
    }
}

/// [`ProstDecoder`] with decode failures as INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct WireDecoder<U> {
    inner: ProstDecoder<U>,
}

impl<U: Message + Default> Decoder for WireDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        // ProstDecoder fails only when the bytes do not decode as `U`; its
        // message is prost's description of the wire problem, never data of
        // the broker's.
        self.inner.decode(buf).map_err(|status| {
            Status::invalid_argument(format!(
                "message does not decode as protobuf: {}",
                status.message()
            ))
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.inner.buffer_settings()
    }
}
