//! What a GET or HEAD serves: an object's bytes across its segments' files, with its exact
//! length.

use super::*;

/// Reads an object's bytes `range` across its segments' (already opened) files.
pub(super) struct SegmentReader {
    pub(super) files: VecDeque<tokio::io::Take<tokio::fs::File>>,
}

impl SegmentReader {
    pub(super) async fn open(
        record: &ObjectRecord,
        files: Vec<tokio::fs::File>,
        range: std::ops::Range<u64>,
    ) -> S3Result<Self> {
        let mut out = VecDeque::new();
        let mut offset = 0u64;
        for (segment, mut file) in record.segments.iter().zip(files) {
            let (start, end) = (offset, offset + segment.size);
            offset = end;
            let from = range.start.max(start);
            let to = range.end.min(end);
            if from >= to {
                continue;
            }
            if from > start {
                file.seek(std::io::SeekFrom::Start(from - start))
                    .await
                    .map_err(|e| internal("cannot seek a data file", e))?;
            }
            out.push_back(file.take(to - from));
        }
        Ok(Self { files: out })
    }
}

impl AsyncRead for SegmentReader {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            let Some(file) = self.files.front_mut() else { return Poll::Ready(Ok(())) };
            let before = buf.filled().len();
            ready!(Pin::new(file).poll_read(cx, buf))?;
            if buf.filled().len() > before || buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            self.files.pop_front();
        }
    }
}

/// An object's body with its exact length, which s3s needs for `Content-Length`.
pub(super) struct ObjectBody {
    pub(super) inner: tokio_util::io::ReaderStream<SegmentReader>,
    pub(super) remaining: u64,
}

impl Stream for ObjectBody {
    type Item = Result<Bytes, s3s::StdError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match ready!(Pin::new(&mut self.inner).poll_next(cx)) {
            Some(Ok(chunk)) => {
                self.remaining = self.remaining.saturating_sub(chunk.len() as u64);
                Poll::Ready(Some(Ok(chunk)))
            }
            Some(Err(e)) => Poll::Ready(Some(Err(Box::new(e)))),
            None if self.remaining > 0 => Poll::Ready(Some(Err(Box::new(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "a data file is shorter than its record",
            ))))),
            None => Poll::Ready(None),
        }
    }
}

impl ByteStream for ObjectBody {
    fn remaining_length(&self) -> RemainingLength {
        RemainingLength::new_exact(usize::try_from(self.remaining).unwrap_or(usize::MAX))
    }
}

/// What a GET or HEAD serves of an object: its bytes `range`, and whether that is part of it
/// (206) and the checksums are served (asked for, of the whole object: as S3).
pub(super) struct Read {
    pub(super) range: std::ops::Range<u64>,
    pub(super) partial: bool,
    pub(super) part_asked: bool,
    pub(super) checksums: bool,
}

impl Read {
    pub(super) fn of(
        record: &ObjectRecord,
        range: Option<&Range>,
        part_number: Option<i32>,
        mode: Option<&ChecksumMode>,
    ) -> S3Result<Self> {
        let partial = range.is_some() || part_number.is_some();
        Ok(Self {
            range: byte_range(record, range, part_number)?,
            partial,
            part_asked: part_number.is_some(),
            checksums: !partial && checksums_asked(mode),
        })
    }

    pub(super) fn content_range(&self, size: u64) -> Option<String> {
        self.partial.then(|| format!("bytes {}-{}/{size}", self.range.start, self.range.end.max(1) - 1))
    }

    pub(super) fn response<T>(&self, output: T) -> S3Response<T> {
        let mut response = S3Response::new(output);
        if self.partial {
            response.status = Some(http::StatusCode::PARTIAL_CONTENT);
        }
        response
    }
}
